"""`tiller view`: a local web app over a run folder's traces.sqlite (docs/viewer.md).

`app.create_app(run_dir)` is the server (FastAPI, read-only SQLite, server-side pages);
`queries` holds its SQL; `static/` the pages, shipped in the package.
"""
