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
            assert name in schemas
    assert doc["channels"]["nodeInstall"]["address"] == "{prefix}.events.node.{node}.install"
    assert "engine" in schemas["InstallProgress"]["required"]
