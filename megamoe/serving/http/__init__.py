"""The OpenAI-compatible HTTP server over the serving engine (``megamoe serve``): :mod:`.server` runs
:mod:`.app` (FastAPI routes, :mod:`.protocol` request shapes) with uvicorn; :mod:`.engine_loop` owns the engine on
one thread; :mod:`.detokenizer` streams text; :mod:`.tokenizer` holds the chat template; :mod:`.metrics` is
``/metrics``. Needs the ``serve`` extra (fastapi, uvicorn, transformers)."""
