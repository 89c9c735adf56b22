"""Continuous batching on the intel target with the trained default model: the scheduler's paged rows
(OpenVINO paged attention) and `kvexport serve` give every request, token for token, what it gets
alone from the stateful engine."""
from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import kvexport
from kvexport.runtime.engine import Engine
from kvexport.runtime.scheduler import Scheduler
from kvexport.zoo import write_named

pytest.importorskip("openvino", reason="the intel target needs openvino (pip install 'kvexport[intel]')")

from kvexport_intel.paged import PagedRows  # noqa: E402

T = 60
PROMPTS = ["def main(", "import os\n", "class Parser:\n    def __init__(self", "x", "return self.",
           "for i in range(", "# read the file\nwith open(", "    if not "]
SAMPLING = [{}, {"temperature": 0.8, "seed": 3}, {}, {"temperature": 1.0, "top_p": 0.9, "seed": 5}, {},
            {"temperature": 0.7, "seed": 11}, {}, {"top_k": 5, "temperature": 1.0, "seed": 1}]


@pytest.fixture(scope="module")
def intel_default(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvexport.build import build

    d = tmp_path_factory.mktemp("intel-default")
    return build(write_named("default", d / "ckpt"), d / "default-intel.kvx", target="intel", max_seq=256,
                 verify=False)


@pytest.fixture(scope="module")
def engine(intel_default: Path) -> Engine:
    return kvexport.load(intel_default, precision="fp32", threads=2)


def test_scheduler_paged_rows_equal_alone_on_the_default_model(engine: Engine) -> None:
    """8 requests (greedy and seeded sampling) through 3 paged rows, prompts entering in chunks of 8:
    every request's tokens and text equal the stateful engine's alone; a retired row frees its blocks."""
    alone = [engine.generate(p, 40, **k) for p, k in zip(PROMPTS, SAMPLING)]
    with Scheduler(engine, max_batch=3, prefill_chunk=8) as s:
        assert isinstance(s.rows, PagedRows)
        hs = [s.submit(p, 40, **k) for p, k in zip(PROMPTS, SAMPLING)]
        res = [h.result(timeout=T) for h in hs]
        assert s.rows.blocks_held() == 0
    assert s.stats.prefill_chunks > len(PROMPTS)
    for a, r in zip(alone, res):
        assert (r.token_ids, r.text, r.finish_reason) == (a.token_ids, a.text, a.finish_reason)


def test_server_on_intel_serves_8_concurrent_requests(intel_default: Path, engine: Engine,
                                                       tmp_path: Path) -> None:
    """`kvexport serve` on an intel artifact, 8 rows: 8 concurrent requests through the openai client,
    plain and streamed, each get token for token what the stateful engine gives that request alone."""
    from tests.test_server import Server

    alone = [engine.generate(p, 32, **k) for p, k in zip(PROMPTS, SAMPLING)]
    server = Server(intel_default, tmp_path / "server.log", "--max-batch", "8", "--option", "precision=fp32")
    try:
        client = server.client()

        def req(i: int, stream: bool = False) -> Any:
            kw: dict[str, Any] = {"temperature": 0, **SAMPLING[i]}
            top_k = kw.pop("top_k", None)
            extra = {"top_k": top_k} if top_k else {}
            if stream:
                parts = client.completions.create(model="default-intel", prompt=PROMPTS[i], max_tokens=32,
                                                  stream=True, extra_body=extra, **kw)
                return "".join(p.choices[0].text for p in parts if p.choices)
            r = client.completions.create(model="default-intel", prompt=PROMPTS[i], max_tokens=32,
                                          extra_body={"return_token_ids": True, **extra}, **kw)
            return r.choices[0].model_extra["token_ids"], r.choices[0].text

        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(req, range(8)))
            streamed = list(pool.map(lambda i: req(i, stream=True), range(8)))
    finally:
        server.stop()
    assert "8 rows decoded in one engine call per decode step" in (tmp_path / "server.log").read_text()
    assert together == [(a.token_ids, a.text) for a in alone]
    assert streamed == [a.text for a in alone]
