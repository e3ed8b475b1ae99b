# The official vLLM image with this project installed (RedisConnector registers itself through
# vLLM's plugin entry point, so kv_connector "RedisConnector" works by name).
# CPU hosts: build with --build-arg VLLM_IMAGE=<vLLM CPU image> (docker-compose.cpu.yml does).
ARG VLLM_IMAGE=vllm/vllm-openai:v0.33.0
FROM ${VLLM_IMAGE}
COPY pyproject.toml README.md /opt/vllm-redis-kvstore/
COPY kvstore /opt/vllm-redis-kvstore/kvstore
COPY connector /opt/vllm-redis-kvstore/connector
COPY scripts /opt/vllm-redis-kvstore/scripts
# --no-deps: the base image already has vLLM, torch and the proxy's FastAPI/httpx/uvicorn
RUN python3 -m pip install --no-cache-dir --no-deps /opt/vllm-redis-kvstore \
 && python3 -m pip install --no-cache-dir "redis[hiredis]>=5" "lz4>=4" "xxhash>=3" "rich>=13"
ENTRYPOINT []
