"""`cullama serve`: an OpenAI-compatible HTTP server (the `serve` extra: FastAPI, uvicorn, pydantic).

    protocol.py   the request bodies (pydantic) and OpenAI-shaped errors
    responses.py  the answers: whole, streamed chunks, Server-Sent Events
    engine.py     the thread that owns the model: one generation at a time, a bounded FIFO queue, cancelling
    app.py        the routes, the API key, every error as OpenAI's error object
    choices.py    n > 1 and lists of prompts: a row of the engine's batch per choice, answered as one
    metrics.py    Prometheus text for /metrics
    launch.py     the process: listen, load in the background, serve, stop on SIGINT/SIGTERM
"""

# Defaults of `cullama serve`'s options, here where the CLI reads them without importing the server's stack.
BODY_TIMEOUT_S = 30.0  # --body-timeout: seconds from a request's headers to its last body byte (past it, a 408)
SHUTDOWN_GRACE_S = 5.0  # --shutdown-grace: seconds open connections get after SIGINT/SIGTERM before they close
