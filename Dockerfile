# r3store server: the service and its admin CLI (no torch).
FROM python:3.11-slim

RUN useradd --create-home --uid 10001 r3store
WORKDIR /app
COPY pyproject.toml README.md LICENSE ./
COPY r3store ./r3store
COPY server ./server
COPY client ./client
RUN pip install --no-cache-dir '.[postgres]'

USER 10001
ENV R3STORE_HOST=0.0.0.0 \
    R3STORE_PORT=8330 \
    R3STORE_DATA_DIR=/var/lib/r3store
EXPOSE 8330
HEALTHCHECK --interval=10s --timeout=3s --retries=5 \
  CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8330/readyz', timeout=2)"
CMD ["r3store-server"]
