"""The interactive API documentation at `/docs`: Swagger UI from the `swagger-ui-py`
package's files, served by the service itself, so it works with no internet access."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS = "/docs/assets"


def swagger_ui_files() -> Path:
    """The directory of Swagger UI's files (found without importing the package, which
    loads a template engine the service does not use)."""
    spec = importlib.util.find_spec("swagger_ui")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the swagger-ui-py package is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "static"


def install(app: FastAPI) -> None:
    """Serve `/docs` and its assets (open, like `/openapi.json`)."""
    app.mount(ASSETS, StaticFiles(directory=swagger_ui_files()), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{app.title} API",
            swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS}/favicon-32x32.png",
            # a key typed into "Authorize" lives in the page only: never in localStorage
            swagger_ui_parameters={"persistAuthorization": False},
        )
