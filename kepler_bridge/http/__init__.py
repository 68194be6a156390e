"""Serving snapshots over HTTP: the gunicorn master, its event-loop worker and the routes.

server.py is the master (bind, one worker, state directory, SIGHUP); worker.py the event-loop
worker, host.py what it needs of the application, wsgi.py its bridge to the WSGI app; app.py the
routes and their guards, dispatch.py the WSGI app that serves them; preflight.py checks the TLS
pair and web config before the fork; tls.py and webconfig.py build what the worker serves TLS and
basic auth with; live_page.py the page at `/`.
"""
