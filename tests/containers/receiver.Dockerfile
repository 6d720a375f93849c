# A stand-in for Jaeger (none can be pulled): OTLP/HTTP on 4318, a query API on 16686.
# Built on llmgw's image for its Python and opentelemetry-proto.
ARG LLMGW_IMAGE
FROM ${LLMGW_IMAGE}
COPY otlp_receiver.py /opt/otlp_receiver.py
EXPOSE 4318 16686
HEALTHCHECK NONE
# An entrypoint, not a command: compose gives Jaeger's `--config …` as the command, which
# the receiver takes as arguments and ignores.
ENTRYPOINT ["python3", "/opt/otlp_receiver.py"]
