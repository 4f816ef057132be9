"""Serve SGLang's real HTTP app (`sglang.srt.entrypoints.http_server.app`) with the test
engine behind it, on the command line `sglang.launch_server` takes (--model-path, --host,
--port; other flags are accepted and ignored). Test-only routes under `/_test/` reset the
engine, read its call log and script failures; `/_test/malformed` makes the next answer of
an endpoint a body that is not JSON. The tests start it once through the adapter's own
launcher (`SGLangProcess`).
"""

# No `from __future__ import annotations` here: FastAPI reads the routes' annotations.
import argparse
import os
import sys
from pathlib import Path

from fastapi import Request
from fastapi.responses import JSONResponse, Response

sys.path.insert(0, str(Path(__file__).parent))

from sglang_test_engine import TestEngine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    args, _ = ap.parse_known_args()
    # /health answers from the app alone: its generation probe reads the runtime context a
    # real launch publishes from ServerArgs (disaggregation mode), which this server lacks.
    os.environ.setdefault("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "false")

    import uvicorn
    from sglang.srt.entrypoints import http_server as hs

    engine = TestEngine()
    hs.set_global_state(
        hs._GlobalState(tokenizer_manager=engine, template_manager=None, scheduler_info={})
    )
    app = hs.app
    malformed: dict[str, int] = {}

    @app.middleware("http")
    async def _malformed(request: Request, call_next):
        path = request.url.path
        if malformed.get(path, 0) > 0:
            malformed[path] -= 1
            await call_next(request)
            return Response(
                content=b'{"text": "", "output_ids": [1, 2', media_type="application/json"
            )
        return await call_next(request)

    @app.post("/_test/reset")
    async def _reset():
        engine.reset()
        malformed.clear()
        return {"ok": True}

    @app.get("/_test/calls")
    async def _calls():
        return JSONResponse(engine.calls)

    @app.post("/_test/script")
    async def _script(request: Request):
        body = await request.json()
        engine.failures.update(body.get("fail", {}))
        engine.token_delay_s = body.get("token_delay_s", engine.token_delay_s)
        engine.hang_s = body.get("hang_s", engine.hang_s)
        if "gracefully_exit" in body:
            engine.gracefully_exit = bool(body["gracefully_exit"])
        for path, times in body.get("malformed", {}).items():
            malformed[path] = int(times)
        return {"ok": True}

    @app.get("/_test/state")
    async def _state():
        return {
            "version": engine.version,
            "paused": engine.is_pause,
            "released": sorted(engine.released),
            "running": sorted(engine.abort_events),
        }

    print(f"test engine behind SGLang's app for model {args.model_path}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, lifespan="off", log_level="warning")


if __name__ == "__main__":
    main()
