from pathlib import Path

from llmgw_core.asyncapi import document, render

DOC = Path(__file__).parent.parent / "docs" / "asyncapi.yaml"


def test_committed_asyncapi_matches_the_message_types() -> None:
    assert DOC.read_text() == render(), (
        "docs/asyncapi.yaml is out of date: run `just asyncapi` (python -m llmgw_core.asyncapi "
        "> docs/asyncapi.yaml) and commit it"
    )


def test_every_channel_names_a_message_with_a_schema() -> None:
    doc = document()
    schemas = doc["components"]["schemas"]
    for channel in doc["channels"].values():
        for ref in channel["messages"].values():
            name = ref["$ref"].rsplit("/", 1)[1]
            message = doc["components"]["messages"][name]
            if "$ref" in message["payload"]:
                assert message["payload"]["$ref"].rsplit("/", 1)[1] in schemas
    assert doc["channels"]["nodeInstall"]["address"] == "{prefix}.events.node.{node}.install"
    assert "engine" in schemas["InstallProgress"]["required"]


def test_dead_letters_servers_streams_and_named_enums_are_in_the_document() -> None:
    doc = document()
    dlq = doc["channels"]["deadLetters"]
    assert dlq["address"] == "{prefix}.dlq.{service}"
    assert set(doc["components"]["messages"]["DeadLetter"]["headers"]["required"]) == {
        "Llmgw-Subject",
        "Llmgw-Error",
    }
    assert dlq["x-llmgw-jetstream"] == {"stream": "{PREFIX}_DLQ"}
    assert doc["servers"]["nats"]["protocol"] == "nats"
    assert doc["channels"]["replicasBucket"]["x-llmgw-jetstream"]["bucket"] == "{prefix}-replicas"
    schemas = doc["components"]["schemas"]
    # Code generators name an inline enum `AnonymousSchemaN`: every enum is a named schema.
    for name, schema in schemas.items():
        for field, prop in schema.get("properties", {}).items():
            assert "enum" not in prop, f"{name}.{field}: an inline enum"
    assert schemas["ShardStatus"]["properties"]["state"]["$ref"] == "#/components/schemas/ShardState"
    assert schemas["ReplicaRecord"]["properties"]["state"]["$ref"] == "#/components/schemas/ReplicaState"
    assert schemas["ShardState"]["title"] == "ShardState"
