"""`kvexport serve` end to end: a real server process on 127.0.0.1, spoken to through the official
`openai` client (and httpx where the test needs the raw HTTP: headers, disconnects, SIGTERM).
Every wait has a timeout; every server is stopped by the test that started it."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import kvexport  # noqa: E402
from kvexport.chat import encode_chat, engine_template  # noqa: E402
from kvexport.runtime.engine import Engine  # noqa: E402

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
MAX_SEQ = 256
T = 60  # seconds: the bound on every wait

CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and now?"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, artifact: Path, log: Path, *args: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {**os.environ, "KVEXPORT_LOG_DIR": str(log.parent)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvexport", "serve", str(artifact), "--port", str(self.port), "--threads", "2",
             *args], stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}: {log.read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server did not come up in 120 s: {log.read_text()}")

    def client(self, **kw: Any) -> Any:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", timeout=T, **kw)

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=T).text)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format -> {'name{labels}': value}; checks every sample has a TYPE."""
    out: dict[str, float] = {}
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
        elif line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            base = key.split("{")[0]
            assert any(base == n or (types[n] == "histogram" and base in (n + "_bucket", n + "_sum", n + "_count"))
                       for n in types), f"{base} has no # TYPE line"
            out[key] = float(value)
    return out


@pytest.fixture(scope="module")
def chat_artifact(tmp_path_factory: pytest.TempPathFactory, checkpoints: dict[str, Path]) -> Path:
    import shutil

    from kvexport.build import build

    d = tmp_path_factory.mktemp("serve")
    ck = d / "ck"
    shutil.copytree(checkpoints["llama"], ck)
    cfg = json.loads((ck / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TEMPLATE
    (ck / "tokenizer_config.json").write_text(json.dumps(cfg))
    return build(ck, d / "tiny-chat.kvx", target="cpu", max_seq=MAX_SEQ, verify=False)


@pytest.fixture(scope="module")
def engine(chat_artifact: Path) -> Engine:
    return kvexport.load(chat_artifact, threads=2)


@pytest.fixture(scope="module")
def server(chat_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(chat_artifact, tmp_path_factory.mktemp("log") / "server.log", "--max-batch", "4", "--max-queue", "8")
    yield s
    s.stop()


def _chat_ids(engine: Engine, messages: list[dict]) -> list[int]:
    t = engine_template(engine)
    assert t is not None
    return encode_chat(engine, t, messages)


def test_models_and_health(server: Server) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny-chat"]
    assert httpx.get(server.url + "/health", timeout=T).json()["status"] == "ok"


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.9, "seed": 4}])
def test_completion_equals_engine(server: Server, engine: Engine, sampling: dict) -> None:
    r = server.client().completions.create(model="tiny-chat", prompt="def main(", max_tokens=24,
                                           extra_body={"return_token_ids": True}, **sampling)
    want = engine.generate("def main(", 24, **sampling)
    c = r.choices[0]
    assert c.model_extra["token_ids"] == want.token_ids
    assert c.text == want.text and c.finish_reason == want.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(want.prompt_ids), 24)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 24 and r.object == "text_completion"


def test_chat_plain_streamed_and_cli(server: Server, engine: Engine, tmp_path: Path) -> None:
    """Plain and streamed chat give the same text, which is the engine's on the rendered conversation,
    and `kvexport run --chat` prints the same for the same messages."""
    client = server.client()
    plain = client.chat.completions.create(model="tiny-chat", messages=CONVERSATION, max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny-chat", messages=CONVERSATION, max_tokens=20,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    want = engine.generate(_chat_ids(engine, CONVERSATION), 20)
    assert plain.choices[0].message.content == want.text
    assert plain.choices[0].message.role == "assistant" and plain.object == "chat.completion"
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == want.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens == len(want.prompt_ids)
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)

    history = tmp_path / "history.json"
    history.write_text(json.dumps(CONVERSATION[:-1]))
    cli = subprocess.run([sys.executable, "-m", "kvexport", "run", str(engine.folder), "--chat", "--messages",
                          str(history), "--prompt", CONVERSATION[-1]["content"], "--max-new-tokens", "20"],
                         capture_output=True, text=True, timeout=T)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout == streamed + "\n"


def test_concurrent_requests_equal_alone(server: Server) -> None:
    """8 requests at once (4 rows: 4 wait in the queue and take freed rows), greedy and seeded, plain
    and streamed: each gets token for token what it gets alone."""
    client = server.client()
    prompts = ["hello", "def f(x):", "import os\n", "a" * 40, "The quick", "zz", "class B:", "print("]

    def req(i: int, stream: bool = False) -> Any:
        kw: dict[str, Any] = {"temperature": 0} if i % 2 == 0 else {"temperature": 1.0, "seed": 100 + i}
        if stream:
            parts = client.completions.create(model="tiny-chat", prompt=prompts[i], max_tokens=32, stream=True, **kw)
            return "".join(p.choices[0].text for p in parts if p.choices)
        r = client.completions.create(model="tiny-chat", prompt=prompts[i], max_tokens=32,
                                      extra_body={"return_token_ids": True}, **kw)
        return r.choices[0].model_extra["token_ids"], r.choices[0].text

    alone = [req(i) for i in range(8)]
    before = server.metrics()
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(req, range(8)))
        streamed = list(pool.map(lambda i: req(i, stream=True), range(8)))
    assert together == alone
    assert streamed == [text for _ids, text in alone]
    after = server.metrics()
    assert after['kvexport_generation_tokens_total{model="tiny-chat"}'] - \
        before['kvexport_generation_tokens_total{model="tiny-chat"}'] == 2 * sum(len(ids) for ids, _ in alone)


def test_stop_string(server: Server, engine: Engine) -> None:
    full = engine.generate("hello", 30).text
    stop = full[6:9]
    r = server.client().completions.create(model="tiny-chat", prompt="hello", max_tokens=30, temperature=0,
                                           stop=[stop, "\x00never"])
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"temperature": 5.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 2}, "n"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"seed": "x"}, "seed"),
    ({"max_tokens": MAX_SEQ}, "max_tokens"),  # prompt + max_tokens beyond max_seq: refused before admission
    ({"prompt": "x" * (MAX_SEQ + 1)}, "prompt"),
    ({"prompt": ""}, "prompt"),
])
def test_bad_request_names_field(server: Server, kwargs: dict, param: str) -> None:
    args = {"model": "tiny-chat", "prompt": "hello", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        server.client(max_retries=0).completions.create(**args)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and param in e.value.body["message"]


def test_bad_chat_and_model(server: Server) -> None:
    client = server.client(max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-chat", messages=[], max_tokens=4)
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": 3}], max_tokens=4)
    assert e.value.body["param"] == "messages[0].content"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=4)
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=T)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_disconnect_frees_row(server: Server) -> None:
    """A streaming client that goes away after its first token: its request is cancelled (its row freed)
    long before its 200 tokens, and the server keeps serving."""
    before = server.metrics().get('kvexport_requests_finished_total{model="tiny-chat",finish_reason="cancelled"}', 0)
    body = {"model": "tiny-chat", "prompt": "x" * 50, "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.Client(timeout=T) as c, c.stream("POST", server.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one token, then leave
    deadline = time.monotonic() + T
    while time.monotonic() < deadline:
        m = server.metrics()
        cancelled = m.get('kvexport_requests_finished_total{model="tiny-chat",finish_reason="cancelled"}', 0)
        if cancelled == before + 1 and m['kvexport_running_rows{model="tiny-chat"}'] == 0:
            break
        time.sleep(0.05)
    assert cancelled == before + 1
    assert m['kvexport_running_rows{model="tiny-chat"}'] == 0
    assert server.client().completions.create(model="tiny-chat", prompt="a", max_tokens=2).usage.completion_tokens == 2


def test_metrics(server: Server) -> None:
    server.client().completions.create(model="tiny-chat", prompt="hello", max_tokens=5)
    m = server.metrics()
    lab = '{model="tiny-chat"}'
    assert m["kvexport_queue_depth" + lab] == 0 and m["kvexport_running_rows" + lab] == 0
    assert m["kvexport_max_batch" + lab] == 4
    assert m["kvexport_generation_tokens_total" + lab] >= 5
    assert m['kvexport_http_responses_total{code="400"}'] >= 1
    assert not any(k.startswith('kvexport_http_responses_total{code="5') for k in m)
    for h in ("kvexport_time_to_first_token_seconds", "kvexport_inter_token_latency_seconds"):
        buckets = [v for k, v in m.items() if k.startswith(h + "_bucket")]
        assert buckets == sorted(buckets) and buckets[-1] == m[h + "_count" + lab] > 0
    assert m["process_resident_memory_bytes"] > 0


def test_queue_full_then_sigterm(chat_artifact: Path, engine: Engine, tmp_path: Path) -> None:
    """One row and one queue place: of 6 requests at once, those beyond answer 429 with Retry-After.
    Then SIGTERM while a stream runs: the stream finishes whole, the process exits 0."""
    s = Server(chat_artifact, tmp_path / "small.log", "--max-batch", "1", "--max-queue", "1", "--prefill-chunk", "1")
    try:
        prompt = "y" * 150  # 150 one-token prefill steps: the first request holds the row a while
        body = {"model": "tiny-chat", "prompt": prompt, "max_tokens": 100, "temperature": 0}
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda _: httpx.post(s.url + "/v1/completions", json=body, timeout=T), range(6)))
        codes = sorted(a.status_code for a in answers)
        assert codes.count(200) >= 1 and 429 in codes and set(codes) <= {200, 429}, codes
        r429 = next(a for a in answers if a.status_code == 429)
        assert r429.headers["Retry-After"] == "1" and r429.json()["error"]["code"] == "queue_full"
        with pytest.raises(openai.RateLimitError):
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda _: s.client(max_retries=0).completions.create(**body), range(4)))

        want = engine.generate(prompt, 100).text
        text, finish, done = "", None, False
        with httpx.Client(timeout=T) as c, c.stream("POST", s.url + "/v1/completions",
                                                     json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                if not text and finish is None and s.proc.poll() is None:
                    s.proc.send_signal(signal.SIGTERM)  # after the first token: the rest must still come
                chunk = json.loads(line[6:])
                text += chunk["choices"][0]["text"]
                finish = chunk["choices"][0]["finish_reason"] or finish
        assert done and finish == "length" and text == want
        assert s.proc.wait(T) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(s.url + "/health", timeout=5)
    finally:
        s.stop()
