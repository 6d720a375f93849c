FROM python:3.11-slim
RUN pip install --no-cache-dir uv==0.13.8
WORKDIR /opt/llmgw
COPY . .
ENV UV_PYTHON_DOWNLOADS=never UV_PROJECT_ENVIRONMENT=/opt/llmgw/.venv PATH=/opt/llmgw/.venv/bin:$PATH
RUN uv sync --frozen --no-dev --no-group engines
