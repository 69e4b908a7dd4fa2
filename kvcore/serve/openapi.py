"""The OpenAPI document at /openapi.json: FastAPI's, plus the request bodies the POST routes
validate themselves (protocol.py's models, read from the raw body under a size limit) and the
model ids this server serves (the base model's, its adapters'), so clients and fuzzers (schemathesis, in the tests) see the API as
it is."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from . import protocol as P

BODIES = {"/v1/chat/completions": P.ChatRequest, "/v1/completions": P.CompletionRequest}
REF = "#/components/schemas/{model}"


def document(app: FastAPI, model_names: list[str]) -> dict:
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                      description="OpenAI-compatible chat and text completions on mlxkv's engine.")
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for path, model in BODIES.items():
        schema = model.model_json_schema(ref_template=REF)
        schemas.update(schema.pop("$defs", {}))
        schema["properties"]["model"] = {"type": "string", "enum": list(model_names), "title": "Model",
                                         "description": "A served model's id (any other: 404)"}
        schemas[model.__name__] = schema
        doc["paths"][path]["post"]["requestBody"] = {
            "required": True, "content": {"application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}}}
    return doc


def install(app: FastAPI, model_names: list[str]) -> None:
    """Serve `document` (built once, on the first request for it)."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = document(app, model_names)
        return app.openapi_schema

    app.openapi = openapi
