# The runtime image: the embedded engine on CPU (the operator image installs `.` without extras).
FROM python:3.11-slim
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin specserve
WORKDIR /app
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY runtime ./runtime
RUN pip install --no-cache-dir '.[cpu]'
ENV SPECSERVE_CACHE=/cache
USER 10001
ENTRYPOINT ["specserve"]
