"""The operator: reconciles InferencePool objects into engines and routers."""
