"""The vLLM engine: a real vLLM OpenAI-compatible server as a subprocess.

vLLM runs from its own venv (``rollout.vllm_python`` or ``SATJAX_VLLM_PYTHON``; on CPU
``scripts/install_vllm_cpu.sh`` makes one) and talks plain HTTP, so the main package
gains no dependency. The first :meth:`VllmEngine.load` starts the server on that
checkpoint; later loads update the weights in place through our worker extension
(:mod:`satjax.rollout.vllm_ext`, over ``/collective_rpc``), reset the prefix cache (its
KV and routes belong to the old weights; retried while vLLM refuses because a request
still holds blocks) and stamp the server's weight version.
:meth:`VllmEngine.apply_deltas` does the same from delta versions: the extension applies
them to its host mirror and updates only what changed. The rollout worker's canary check
(:meth:`canary_logprobs`, vLLM ``prompt_logprobs``) then guards the update.

Per completion vLLM returns the sampled tokens, their log-probs under the processed
sampling distribution (``--logprobs-mode processed_logprobs``) and the router record of
every prompt and response token but the last (``--enable-return-routed-experts``,
base64 ``.npy`` ``[P + N - 1, L, w]``): the plug-in widens vLLM's routed expert ids with
their gate weights and, on request, the router logits
(:mod:`satjax.rollout.vllm_packing`). A partial rollout (``generate(..., sync=...)``)
runs in segments and continues each sequence after a weight update by resubmitting its
prompt and the tokens so far. See docs/vllm.md.
"""

from __future__ import annotations

import atexit
import base64
import concurrent.futures as cf
import dataclasses
import http.client
import io
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from satjax.rollout.engine import Completion, SamplingParams, Sync
from satjax.rollout.vllm_packing import RECORD_ENV, RouterLayout
from satjax.utils import free_port, tied_to_this_process

REPO_ROOT = Path(__file__).resolve().parents[2]
EXTENSION = "satjax.rollout.vllm_ext.WeightExt"
SERVED_NAME = "satjax"
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}
# fp32 serving reproduces the trainer's fp32 log-probs to ~1e-6; a bf16 server is ~4e-3
# off on the tiny model (measured), while a corrupted sync moves them by nats
_CANARY_ATOL = {"float32": 1e-4, "bfloat16": 0.05}
# Response tokens per request between two checks for new weights under ``rollout.partial``
# (the built-in engine's SEGMENT_TOKENS is 4): each segment is one more HTTP request per
# unfinished sequence, which re-reads its prefix (from vLLM's prefix cache while the
# version holds), so segments are longer here; a version published mid-segment waits for
# the segment's end.
SEGMENT_TOKENS = 16
_SERVER_ENV = {
    "VLLM_SERVER_DEV_MODE": "1",  # enables /collective_rpc and /reset_prefix_cache
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the CPU default takes a large share of RAM
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # shared cores: do not pin OpenMP threads
    "HF_HUB_OFFLINE": "1",
}


class VllmError(RuntimeError):
    """The vLLM server failed to start, or answered a request with an error."""


def resolve_python(configured: str = "") -> str:
    """The vLLM venv's interpreter: ``configured`` (``rollout.vllm_python``), else
    ``$SATJAX_VLLM_PYTHON``; raises ValueError unless it can import vllm."""
    python = configured or os.environ.get("SATJAX_VLLM_PYTHON", "")
    if not python:
        raise ValueError(
            "rollout.vllm_python: not set and SATJAX_VLLM_PYTHON is unset; point one of them "
            "at the python of a venv with vLLM (CPU: scripts/install_vllm_cpu.sh, then "
            "SATJAX_VLLM_PYTHON=.venv-vllm/bin/python)"
        )
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        ok = subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        raise ValueError(f"rollout.vllm_python: {python!r} is not a python that can import vllm")
    return python


def decode_routes(encoded: str) -> np.ndarray:
    """vLLM's base64 ``.npy`` routed experts -> int32 ``[T, L, w]`` (packed rows)."""
    return np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False).astype(np.int32)


def request_seed(seed: int, index: int) -> int:
    """Distinct, reproducible per-request seeds (the worker repeats each prompt
    ``group_size`` times, so one seed for the whole batch would repeat samples)."""
    return (int(seed) * 1_000_003 + index * 7_919 + 1) % (2**31 - 1)


PLUGIN = "satjax_router_record = satjax.rollout.vllm_ext:register"


def write_plugin(directory: Path) -> Path:
    """A ``*.dist-info`` under ``directory`` declaring :data:`PLUGIN` in vLLM's
    ``vllm.general_plugins`` entry-point group, so that a vLLM with ``directory`` on its
    ``PYTHONPATH`` loads our router record in every process it starts (API server, engine
    core, workers) without satjax being installed in the vLLM venv; returns ``directory``."""
    info = Path(directory) / "satjax_vllm_plugin-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: satjax-vllm-plugin\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{PLUGIN}\n")
    return Path(directory)


def completion_request(prompt: Sequence[int], sampling: SamplingParams, seed: int,
                       routes_from: int = 0) -> dict:
    """The ``/v1/completions`` body for one prompt of token ids; its router record from
    input position ``routes_from`` on (vLLM's ``routed_experts_prompt_start``)."""
    return {
        "model": SERVED_NAME,
        "prompt": [int(t) for t in prompt],
        "n": 1,
        "max_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        "stop_token_ids": list(sampling.stop_token_ids),
        "seed": seed,
        "logprobs": 0,  # the sampled token's log-prob only
        "return_token_ids": True,
        # without a tokenizer the server can only name log-prob tokens by id
        "return_tokens_as_token_ids": True,
        "detokenize": False,
        "skip_special_tokens": False,
        "routed_experts_prompt_start": int(routes_from),
    }


def parse_choice(prompt: Sequence[int], choice: dict[str, Any],
                 layout: RouterLayout, routes_from: int = 0) -> Completion:
    """One ``/v1/completions`` choice -> :class:`Completion`, its router record split
    by ``layout``: the rows of input positions ``routes_from`` .. ``P + N - 2``."""
    tokens = np.asarray(choice.get("token_ids") or [], np.int32)
    logprobs = np.asarray((choice.get("logprobs") or {}).get("token_logprobs") or [], np.float32)
    if logprobs.shape != tokens.shape:
        raise VllmError(f"vLLM returned {tokens.size} tokens but {logprobs.size} log-probs")
    finish = choice.get("finish_reason")
    if finish not in ("stop", "length"):
        raise VllmError(f"vLLM finished a request with {finish!r}")
    encoded = choice.get("routed_experts")
    if not encoded:
        raise VllmError("vLLM returned no routed_experts; is --enable-return-routed-experts on?")
    packed = decode_routes(encoded)
    expected = len(prompt) + tokens.size - 1 - routes_from
    if packed.shape[0] != expected:
        raise VllmError(f"routed_experts has {packed.shape[0]} rows, expected {expected}")
    try:
        routes, gates, logits = layout.split(packed)
    except ValueError as e:  # a server started without (or with another) record
        raise VllmError(str(e)) from None
    return Completion(
        prompt_tokens=np.asarray(prompt, np.int32), response_tokens=tokens,
        logprobs=logprobs, routed_experts=routes, finish_reason=finish,
        routed_gates=gates, router_logits=logits,
    )


def join_segments(prompt: Sequence[int], segments: Sequence[Completion],
                  versions: Sequence[int]) -> Completion:
    """One completion from the segments of a partial rollout: ``segments[0]`` sampled from
    ``prompt`` (its rows cover the prompt), each next one from the prompt and the tokens
    before it, with the rows of its own tokens only (``routes_from``); ``versions[j]`` the
    version that sampled segment j. Rows and tokens stay with the version that computed
    them: row ``P - 1 + j`` is the forward that sampled response token j."""
    def cat(field: str) -> np.ndarray | None:
        parts = [getattr(c, field) for c in segments]
        return None if any(p is None for p in parts) else np.concatenate(parts)

    def cat_all(field: str) -> np.ndarray:
        return np.concatenate([getattr(c, field) for c in segments])

    return Completion(
        prompt_tokens=np.asarray(prompt, np.int32),
        response_tokens=cat_all("response_tokens"),
        logprobs=cat_all("logprobs"),
        routed_experts=cat_all("routed_experts"),
        finish_reason=segments[-1].finish_reason,
        routed_gates=cat("routed_gates"),
        router_logits=cat("router_logits"),
        token_versions=np.concatenate([np.full(len(c.response_tokens), v, np.int32)
                                       for c, v in zip(segments, versions, strict=True)]),
    )


class VllmEngine:
    """Engine protocol over a vLLM server subprocess (see the module docstring).

    ``python``: the vLLM venv's interpreter (``resolve_python``); ``dtype``: the serving
    dtype (``rollout.sample_dtype``); ``seed``: the server's sampling seed;
    ``record_router_logits``: also return each token's router logits (float16
    ``[P+N-1, L, E]``; gate weights are always returned); ``segment_tokens``: response
    tokens per request between two ``sync`` calls of a partial rollout.
    """

    name = "vllm"

    def __init__(
        self,
        *,
        python: str | None = None,
        dtype: str = "float32",
        seed: int = 0,
        max_model_len: int | None = None,
        startup_timeout_s: float = 900.0,
        request_timeout_s: float = 600.0,
        max_concurrency: int = 64,
        log_dir: str | os.PathLike[str] | None = None,
        extra_args: Sequence[str] = (),
        record_router_logits: bool = False,
        segment_tokens: int = SEGMENT_TOKENS,
    ) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype: one of {sorted(_DTYPES)}, got {dtype!r}")
        if max_model_len is not None and max_model_len < 2:
            raise ValueError(f"max_model_len: must be >= 2, got {max_model_len}")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency: must be >= 1, got {max_concurrency}")
        if segment_tokens < 1:
            raise ValueError(f"segment_tokens: must be >= 1, got {segment_tokens}")
        self.python = resolve_python(python or "")
        self.dtype = dtype
        self.canary_atol = _CANARY_ATOL[dtype]
        self.max_model_len = max_model_len
        self.seed = int(seed)
        self.startup_timeout_s = startup_timeout_s
        self.request_timeout_s = request_timeout_s
        self.max_concurrency = max_concurrency
        self.segment_tokens = segment_tokens
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="satjax-vllm-"))
        self.extra_args = tuple(extra_args)
        self.record_parts = ("gates", "logits") if record_router_logits else ("gates",)
        self.layout: RouterLayout | None = None  # from the checkpoint the server starts on
        self.version: int | None = None
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self.log_path = self.log_dir / "vllm-server.log"
        self.last_sync_s: float | None = None
        self.last_sync_info: dict[str, Any] = {}
        # the version the server started from, until the extension's mirror holds it
        self._unmirrored: Path | None = None
        atexit.register(self.close)

    # -- server lifecycle ------------------------------------------------------------
    def _command(self, checkpoint_dir: Path) -> list[str]:
        max_len = self.max_model_len or _model_max_len(checkpoint_dir)
        return [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(checkpoint_dir), "--served-model-name", SERVED_NAME,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", self.dtype, "--enforce-eager", "--max-model-len", str(max_len),
            "--seed", str(self.seed),
            "--skip-tokenizer-init",  # token ids in and out; no tokenizer files needed
            "--logprobs-mode", "processed_logprobs",
            "--enable-return-routed-experts",
            "--worker-extension-cls", EXTENSION,
            *self.extra_args,
        ]

    def start(self, checkpoint_dir: Path) -> None:
        """Starts the server on ``checkpoint_dir`` and waits until ``/health`` answers."""
        if self.proc is not None:
            raise VllmError("the vLLM server is already running")
        cfg = _model_config(checkpoint_dir)
        self.layout = RouterLayout(int(cfg["num_experts_per_tok"]), int(cfg["num_experts"]),
                                   self.record_parts)
        self.port = free_port()
        env = dict(os.environ)
        env.update(_SERVER_ENV)
        env[RECORD_ENV] = ",".join(self.record_parts)  # read by the plug-in at import
        plugin = write_plugin(self.log_dir / "vllm-plugin")
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), str(plugin), env.get("PYTHONPATH", "")) if p)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            # own session: close() signals the whole group (api server + engine core)
            # a worker killed -9 must not leave it running: the server dies with the thread
            self.proc = subprocess.Popen(
                tied_to_this_process(self._command(checkpoint_dir)), stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True,
            )
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.proc = None
                raise VllmError(f"vLLM server exited with {code} during startup\n{self.log_tail()}")
            try:
                if self._request("GET", "/health", None, timeout=5)[0] == 200:
                    return
            except (OSError, http.client.HTTPException):
                pass  # not listening yet
            if time.monotonic() > deadline:
                self.close()
                raise VllmError(
                    f"vLLM server not healthy after {self.startup_timeout_s:.0f}s\n"
                    f"{self.log_tail()}")
            time.sleep(1.0)

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return f"(no server log at {self.log_path})"
        return f"--- last {lines} lines of {self.log_path}:\n" + "\n".join(text[-lines:])

    def close(self, grace_s: float = 30.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``grace_s``."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # the engine core may outlive the api server a moment; end the group
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- HTTP ------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: dict | None,
                 timeout: float | None = None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port,
                                          timeout=timeout or self.request_timeout_s)
        try:
            data = json.dumps(body).encode() if body is not None else None
            conn.request(method, path, body=data,
                         headers={"Content-Type": "application/json"} if data else {})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def _post(self, path: str, body: dict | None = None) -> Any:
        if self.proc is None:
            raise VllmError(f"POST {path}: the vLLM server is not running (call load() first)")
        status, data = self._request("POST", path, body)
        if status != 200:
            raise VllmError(f"POST {path} -> HTTP {status}: {data[:2000].decode(errors='replace')}")
        return json.loads(data) if data.strip() else None

    # -- Engine protocol -------------------------------------------------------------
    def load(self, checkpoint_dir: Path, version: int) -> None:
        """Serves ``checkpoint_dir`` as ``version``: starts the server the first time,
        afterwards updates its weights in place."""
        checkpoint_dir = Path(checkpoint_dir).resolve()
        t0 = time.perf_counter()
        if self.proc is None:
            self.start(checkpoint_dir)
            self.last_sync_info = {"started": True}
            self._unmirrored = checkpoint_dir  # read by the first apply_deltas, if any
        else:
            self.version = None  # until the update is through
            self.last_sync_info = self._rpc("update_weights_from_dir", str(checkpoint_dir))
            self._unmirrored = None
            self._reset_prefix_cache()  # its KV and routes are the old weights'
        self._stamp(version, t0)

    def apply_deltas(self, delta_dirs: Sequence[Path], version: int) -> None:
        """Moves the served weights through the delta versions ``delta_dirs`` in place
        (``vllm_ext.WeightExt.apply_weight_deltas``: only the tensors that changed)."""
        if self.proc is None:
            raise VllmError("apply_deltas before load(): the server serves no version")
        t0 = time.perf_counter()
        self.version = None
        base, self._unmirrored = self._unmirrored, None
        self.last_sync_info = self._rpc(
            "apply_weight_deltas", [str(Path(d).resolve()) for d in delta_dirs],
            None if base is None else str(base))
        self._reset_prefix_cache()
        self._stamp(version, t0)

    def _reset_prefix_cache(self) -> None:
        """Empties vLLM's prefix cache after an update: its blocks hold the old weights'
        KV and router rows, which a later request with the same prefix would otherwise be
        served (cached prompt tokens are not forwarded again). vLLM refuses while any
        request holds KV blocks (HTTP 200 with ``{"success": false}``: a request still
        running, e.g. one whose caller gave up), so the reset is retried until they end,
        for up to ``request_timeout_s``; then :class:`VllmError`. The number of tries is
        ``last_sync_info["prefix_cache_reset_tries"]``."""
        deadline = time.monotonic() + self.request_timeout_s
        delay, tries = 0.02, 0
        while True:
            tries += 1
            reply = self._post("/reset_prefix_cache")
            # an empty reply: a vLLM from before the success flag (it could not refuse)
            if not isinstance(reply, dict) or reply.get("success", True):
                self.last_sync_info["prefix_cache_reset_tries"] = tries
                return
            if time.monotonic() > deadline:
                raise VllmError(
                    f"vLLM refused to reset its prefix cache {tries} times over "
                    f"{self.request_timeout_s:.0f}s (requests still hold KV blocks); the "
                    "cache would serve the old weights' KV and routes")
            time.sleep(delay)
            delay = min(2 * delay, 0.5)

    def _rpc(self, method: str, *args: Any) -> dict[str, Any]:
        """Runs ``method`` of the worker extension in every vLLM worker; the first
        worker's JSON reply."""
        reply = self._post("/collective_rpc", {"method": method, "args": list(args)})
        results = (reply or {}).get("results") or []
        if not results:
            raise VllmError(f"{method} returned no worker results: {reply!r}")
        return json.loads(results[0])

    def _stamp(self, version: int, t0: float) -> None:
        """The server reports ``version`` (``/weight_info``); so does the engine."""
        self._post("/update_weight_version", {"new_version": str(int(version))})
        self.last_sync_s = time.perf_counter() - t0
        self.version = int(version)

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, seed: int,
        sync: Sync | None = None,
    ) -> list[Completion]:
        """One completion per prompt; requests run concurrently (vLLM batches them).

        With ``sync`` (a partial rollout) each request asks for at most
        ``segment_tokens`` tokens; between segments ``sync()`` may load new weights, and
        each unfinished sequence goes on as a new request whose prompt is its prompt and
        the tokens so far (after an update the prefix cache is empty, so the new version
        recomputes that prefix's KV). Each token keeps the log-prob and router rows of the
        version that sampled it (``join_segments``) and is stamped with it
        (``token_versions``)."""
        if not prompts:
            raise ValueError("prompts must be a non-empty list")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("prompts must each contain at least one token")
        layout, version = self.layout, self.version
        if layout is None or version is None:
            raise VllmError("generate: the server serves no whole version (load() first)")
        budget = sampling.max_new_tokens if sync is None else self.segment_tokens
        segments: list[list[Completion]] = [[] for _ in prompts]
        versions: list[list[int]] = [[] for _ in prompts]

        def one(i: int, segment: int) -> Completion:
            done = segments[i]
            n = sum(len(c.response_tokens) for c in done)
            head = [*prompts[i], *(int(t) for c in done for t in c.response_tokens)]
            # a continuation's rows start at the last token it is given: never forwarded
            # before, it is the forward that samples the segment's first token
            start = len(head) - 1 if done else 0
            part = dataclasses.replace(
                sampling, max_new_tokens=min(budget, sampling.max_new_tokens - n))
            # each segment its own seed: a repeated one would reuse its random draws
            seed_i = request_seed(seed, i) if segment == 0 else request_seed(
                request_seed(seed, i), segment)
            reply = self._post("/v1/completions",
                               completion_request(head, part, seed_i, routes_from=start))
            return parse_choice(head, reply["choices"][0], layout, routes_from=start)

        active = list(range(len(prompts)))
        segment = 0
        with cf.ThreadPoolExecutor(min(self.max_concurrency, len(prompts))) as pool:
            while True:
                for i, c in zip(active, pool.map(one, active, [segment] * len(active)),
                                strict=True):
                    segments[i].append(c)
                    versions[i].append(version)
                # unfinished: stopped by the segment's budget (not by a stop token, nor
                # short of it at the model's length) before max_new_tokens
                active = [i for i in active if segments[i][-1].finish_reason == "length"
                          and len(segments[i][-1].response_tokens) == budget
                          and sum(len(c.response_tokens) for c in segments[i])
                          < sampling.max_new_tokens]
                if sync is None or not active:
                    break
                sync()
                version = self.version
                if version is None:
                    raise VllmError("no whole version served after sync")
                segment += 1
        if sync is None:
            return [s[0] for s in segments]
        return [join_segments(p, s, v) for p, s, v in zip(prompts, segments, versions,
                                                           strict=True)]

    def canary_logprobs(self, tokens: list[int]) -> list[float]:
        """Teacher-forced log-probs of ``tokens[1:]`` (vLLM ``prompt_logprobs``, T = 1)."""
        if len(tokens) < 2:
            raise ValueError(f"tokens: need at least 2, got {len(tokens)}")
        reply = self._post("/v1/completions", {
            "model": SERVED_NAME, "prompt": [int(t) for t in tokens], "max_tokens": 1,
            "temperature": 1.0, "top_p": 1.0, "top_k": -1, "prompt_logprobs": 0,
            "detokenize": False,
        })
        rows = reply["choices"][0]["prompt_logprobs"]
        return [float(rows[i][str(int(tokens[i]))]["logprob"]) for i in range(1, len(tokens))]

    def vllm_version(self) -> str | None:
        """The server's vLLM version (``/version``)."""
        status, data = self._request("GET", "/version", None, timeout=30)
        return json.loads(data).get("version") if status == 200 else None

    def weight_version(self) -> str | None:
        """The version string the server reports (``/weight_info``)."""
        status, data = self._request("GET", "/weight_info", None, timeout=30)
        return json.loads(data).get("weight_version") if status == 200 else None


def _model_config(checkpoint_dir: Path) -> dict[str, Any]:
    return json.loads((Path(checkpoint_dir) / "config.json").read_text())


def _model_max_len(checkpoint_dir: Path, cap: int = 8192) -> int:
    return int(min(_model_config(checkpoint_dir).get("max_position_embeddings", cap), cap))
