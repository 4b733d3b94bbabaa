"""LiteLLM's capture in bench/gateway.py: a custom callback, the proxy's documented way to log every call
without an external service (its own request/response store, the spend logs, needs PostgreSQL through
Prisma, whose engine binaries are downloaded at start-up; nothing but the package indexes is reachable
here). Each successful call's standard logging payload (messages, parameters, the response object, usage)
is appended to $POLAR_BENCH_CAPTURE as one JSON line, after the answer was sent, as LiteLLM runs success
callbacks. Runs inside LiteLLM's venv, loaded by its proxy from the config's folder."""

import os

import orjson
from litellm.integrations.custom_logger import CustomLogger


class Capture(CustomLogger):
    def __init__(self) -> None:
        super().__init__()
        self.out = open(os.environ["POLAR_BENCH_CAPTURE"], "ab")  # noqa: SIM115 (open for the process)

    async def async_log_success_event(self, kwargs, response_obj, start_time, end_time):  # type: ignore[no-untyped-def]
        payload = kwargs.get("standard_logging_object")
        self.out.write(orjson.dumps(payload, default=str, option=orjson.OPT_APPEND_NEWLINE))
        self.out.flush()


handler = Capture()
