"""vramplan's local web page: ``vramplan web`` serves it (needs ``pip install 'vramplan[web]'``).

- :mod:`vramplan.web.app` — the Starlette app and its JSON endpoints (``create_app``);
- :mod:`vramplan.web.params` — the page's query string ↔ Workload, errors tagged with their field;
- :mod:`vramplan.web.jobs` — traces and searches in worker processes, newest request first;
- :mod:`vramplan.web.work` — the computations, through the root API;
- ``static/`` — the page: one HTML file, one vanilla JS file, one CSS file (no build step).
"""
