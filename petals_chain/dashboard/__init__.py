"""Public swarm dashboard: the page (served by the orchestrator at ``/``) and the standalone DHT reader.

``mount_dashboard(app)`` adds the page to a FastAPI app that serves ``GET /api/v1/swarm`` (contracts E);
``python -m petals_chain.dashboard --initial-peers MADDR`` runs the standalone dashboard.
"""

from petals_chain.dashboard.app import create_app, mount_dashboard, page_headers, page_html, page_response

__all__ = ["mount_dashboard", "page_html", "page_headers", "page_response", "create_app"]
