"""kvmesh: a Kubernetes-native control plane for LLM inference that treats the KV cache as a cluster-wide resource."""

__version__ = "0.1.0"
