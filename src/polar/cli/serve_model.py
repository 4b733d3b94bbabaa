"""`polar serve-model [MODEL]`: serve a policy with the embedded engine (vLLM's HTTP API)."""

from __future__ import annotations

import click

from polar.cli.common import log_level_option, setup_logging


@click.command("serve-model")
@click.argument("model", required=False)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--served-model-name", default=None, help="Name clients send as `model` (default: MODEL).")
@click.option("--device", default="auto", show_default=True, help="cpu, cuda, cuda:1, ... or auto.")
@click.option("--dtype", default="auto", show_default=True, help="float32, bfloat16, float16 or auto.")
@click.option("--max-model-len", default=None, type=int, help="Context length (default: the model's).")
@click.option("--max-num-seqs", default=16, show_default=True, type=int, help="Sequences batched at once.")
@click.option(
    "--prefill-chunk", default=512, show_default=True, type=int, help="Prompt tokens per prefill step."
)
@click.option(
    "--prefix-cache-gb", default=1.0, show_default=True, type=float, help="Prefix cache size; 0 disables."
)
@click.option(
    "--default-max-tokens",
    default=None,
    type=int,
    help="Cap for chat requests without max_tokens (default: rest of context; 256 for the tiny default model).",
)
@click.option(
    "--tool-call-parser",
    default="auto",
    show_default=True,
    help="hermes, qwen3_coder, llama3_json, mistral, auto or none.",
)
@click.option(
    "--reasoning-parser", default="auto", show_default=True, help="qwen3, deepseek_r1, auto or none."
)
@click.option(
    "--trust-request-chat-template", is_flag=True, help="Allow requests to bring their own chat template."
)
@log_level_option
def serve_model(
    model: str | None,
    host: str,
    port: int,
    served_model_name: str | None,
    device: str,
    dtype: str,
    max_model_len: int | None,
    max_num_seqs: int,
    prefill_chunk: int,
    prefix_cache_gb: float,
    default_max_tokens: int | None,
    tool_call_parser: str,
    reasoning_parser: str,
    trust_request_chat_template: bool,
    log_level: str,
    log_json: bool,
) -> None:
    """Serve MODEL (a Hugging Face id, a local folder or a .gguf file) on an OpenAI/vLLM-compatible API.

    Without MODEL it serves the offline default: the real Qwen3 tokenizer and chat template with tiny random
    weights, built once into $POLAR_HOME/models (or ~/.cache/polar/models). It is for plumbing, not quality.

    \b
    Examples:
      polar serve-model                                  # the offline default on :8000
      polar serve-model Qwen/Qwen3-0.6B --port 8001 --device cuda --dtype bfloat16
      polar serve-model ./model.gguf --served-model-name policy
    """
    from polar.cli.common import cannot_start, one_line, serve_until_stopped
    from polar.extras import ENGINE, require_cli
    from polar.modelsource import ModelNotFound, prepare_model
    from polar.serving import BindError, EmbeddedServer

    require_cli(ENGINE)
    setup_logging(log_level, json=log_json)
    # The port first (a port in use is said before minutes of loading), then the model: one that is not
    # here and cannot be downloaded now (offline) fails at once, in one line.
    server = EmbeddedServer(None, host, port, log_level=log_level.lower())
    try:
        server.bind()
    except BindError as exc:
        raise cannot_start(f"{exc}" + (" (another polar serve-model?)" if exc.in_use else "")) from None
    try:
        prepare_model(model)
    except ModelNotFound as exc:
        raise cannot_start(one_line(exc)) from None

    from polar.engine import Engine, EngineConfig, create_engine_app

    config = EngineConfig(
        max_num_seqs=max_num_seqs,
        prefill_chunk=prefill_chunk,
        prefix_cache_gb=prefix_cache_gb,
        default_max_tokens=default_max_tokens,
        tool_call_parser=None if tool_call_parser == "none" else tool_call_parser,
        reasoning_parser=reasoning_parser,
        trust_request_chat_template=trust_request_chat_template,
    )
    try:
        engine = Engine.load(
            model,
            device=device,
            dtype=dtype,
            max_model_len=max_model_len,
            served_name=served_model_name,
            config=config,
            start=False,
        )
    except (OSError, ValueError, RuntimeError) as exc:
        raise cannot_start(f"cannot load {model or 'the default model'}: {one_line(exc)}") from None
    server.app = create_engine_app(engine, manage_engine=True)

    def started() -> None:
        click.echo(
            f"serving {engine.name} (max_model_len {engine.max_model_len}, "
            f"tool parser {getattr(engine.tool_parser, 'name', None)}, reasoning {engine.reasoning}) "
            f"on {server.url}/v1",
            err=True,
        )

    serve_until_stopped([server], started=started)
