# The official vLLM image with this project installed (RedisConnector registers itself through
# vLLM's plugin entry point, so kv_connector "RedisConnector" works by name).
# CPU hosts: build with --build-arg VLLM_IMAGE=<vLLM CPU image> (docker-compose.cpu.yml does).
ARG VLLM_IMAGE=vllm/vllm-openai:v0.33.0
FROM ${VLLM_IMAGE}
COPY pyproject.toml setup.py README.md /opt/vllm-redis-kvstore/
COPY kvstore /opt/vllm-redis-kvstore/kvstore
COPY connector /opt/vllm-redis-kvstore/connector
COPY datamover /opt/vllm-redis-kvstore/datamover
# Dependencies come from pyproject.toml; the image's vLLM and torch already satisfy theirs.
# setup.py builds the compiled reply reader where the image has a C compiler (else Python reads).
RUN python3 -m pip install --no-cache-dir "/opt/vllm-redis-kvstore[cli,proxy,lz4]"
ENTRYPOINT []
