"""OpenAI-compatible HTTP server: ``protocol`` (bodies), ``serving`` (route logic), ``metrics``
(Prometheus and the log line), ``api_server`` (the FastAPI app)."""
