"""LoRA adapters served: a client picks one by ``model`` (OpenAI) or the gRPC ``model`` field,
and requests of two adapters and the base model, in flight together on one engine, each get
what the offline engine gives them; /v1/models lists the adapters under their base; an unknown
name is 404 / NOT_FOUND naming it, whether the ingress or the engine finds it unknown.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from deployments.contract import EngineRequest
from engine import LLM, SamplingParams
from engine.errors import UnknownAdapterError
from tests.factories import make_lora_dir

TEXT = "Adapters share one base model"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def lora(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("served-adapters")
    adapters = {name: str(make_lora_dir(tiny_model_dir, root / name, rank=4, seed=i, scale=1.0))
                for i, name in enumerate(("alpha", "beta"))}
    return {"adapters": adapters, "max_loras": 2, "max_lora_rank": 4}


@pytest.fixture(scope="module")
def offline(tiny_model_dir, lora):
    """The offline engine's greedy text for the base model and each adapter."""
    from tests.real_serving import ENGINE

    llm = LLM(str(tiny_model_dir), **ENGINE, lora=lora)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    names = [None, "alpha", "beta"]
    outs = llm.generate([TEXT] * 3, params, lora=names)
    texts = {name: o.outputs[0].text for name, o in zip(names, outs)}
    assert len(set(texts.values())) == 3, "each adapter must change the output"
    return texts


def _openai(frontend):
    import httpx2
    import openai

    from deployments.openai_api import build_openai_app

    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=build_openai_app(frontend)))
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http), http


def test_openai_and_grpc_pick_adapters_by_model_in_one_batch(tiny_model_dir, tokenizer, lora, offline):
    import openai

    from deployments.errors import ModelNotFound
    from deployments.proto_gen.slotserve.v1 import slotserve_pb2 as pb
    from tests.real_serving import GrpcContext, GrpcService, real_frontend

    async def grpc_text(frontend, model):
        request = pb.GenerateRequest(model=model, prompt=TEXT, sampling=pb.SamplingOptions(
            temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
        messages = [m async for m in GrpcService(frontend).Generate(request.SerializeToString(), GrpcContext())]
        return "".join(m.text for m in messages)

    async def main():
        async with real_frontend(tiny_model_dir, tokenizer, lora=lora) as (frontend, replica):
            client, http = _openai(frontend)
            calls = [client.completions.create(model=m, prompt=TEXT, max_tokens=MAX_TOKENS, temperature=0,
                                               extra_body={"ignore_eos": True}) for m in ("tiny", "alpha", "beta")]
            *whole, beta_grpc = await asyncio.gather(*calls, grpc_text(frontend, "beta"))
            models = await client.models.list()
            alpha = await client.models.retrieve("alpha")
            with pytest.raises(openai.NotFoundError, match="'gamma' is not served here"):
                await client.completions.create(model="gamma", prompt=TEXT, max_tokens=2)
            context = GrpcContext()
            request = pb.GenerateRequest(model="gamma", prompt=TEXT)
            with pytest.raises(ModelNotFound):
                [m async for m in GrpcService(frontend).Generate(request.SerializeToString(), context)]
            await http.aclose()
            return whole, beta_grpc, models, alpha, context, replica.engine.stats()

    whole, beta_grpc, models, alpha, context, stats = asyncio.run(asyncio.wait_for(main(), 120))
    assert [c.choices[0].text for c in whole] == [offline[None], offline["alpha"], offline["beta"]]
    assert beta_grpc == offline["beta"]
    assert [(m.id, getattr(m, "parent", None)) for m in models.data] == [("tiny", None), ("alpha", "tiny"),
                                                                        ("beta", "tiny")]
    assert alpha.id == "alpha" and alpha.parent == "tiny"
    assert context.code == grpc.StatusCode.NOT_FOUND and "'gamma'" in context.details
    assert stats.running == 0 and stats.kv_blocks_used <= stats.kv_blocks_total


def test_an_adapter_the_engine_lacks_is_not_found_naming_it(tiny_model_dir, tokenizer, lora):
    """The ingress lists an adapter its engine does not serve (configs out of step): the engine's
    refusal reaches the client as 404 naming it, and the engine serves the next request."""
    import openai

    from tests.real_serving import real_frontend

    async def main():
        async with real_frontend(tiny_model_dir, tokenizer, lora=lora, lora_adapters=("alpha", "ghost")) as (
                frontend, _):
            client, http = _openai(frontend)
            with pytest.raises(openai.NotFoundError, match="adapter 'ghost' is not loaded; loaded: alpha, beta"):
                await client.completions.create(model="ghost", prompt=TEXT, max_tokens=2)
            ok = await client.completions.create(model="alpha", prompt=TEXT, max_tokens=2)
            await http.aclose()
            return ok

    assert asyncio.run(asyncio.wait_for(main(), 60)).choices[0].text is not None


def test_load_at_run_time_over_http_then_a_new_replica_reads_it_on_demand(tiny_model_dir, tokenizer, tmp_path):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter: a loaded adapter is served at once
    and listed; a replica started later reads it when a request for it arrives; refusals name the
    field (runtime loading off, a path outside lora_load_dir, a taken name, a broken adapter)."""
    import httpx2

    from deployments.engine_client import LocalEngineClient
    from deployments.frontend import Frontend, FrontendConfig
    from deployments.openai_api import build_openai_app
    from deployments.replica import EngineReplica
    from tests.real_serving import ENGINE

    adapters_dir = tmp_path / "adapters"
    make_lora_dir(tiny_model_dir, adapters_dir / "gamma", rank=4, seed=7, scale=1.0)
    make_lora_dir(tiny_model_dir, adapters_dir / "too-big", rank=8, seed=7)
    engine = {**ENGINE, "lora": {"max_loras": 1, "max_lora_rank": 4}}
    body = {"model": "gamma", "prompt": TEXT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}

    def frontend_over(replicas, load_dir=str(adapters_dir)):
        config = FrontendConfig(served_model_name="tiny", model=str(tiny_model_dir), lora_load_dir=load_dir)
        return httpx2.AsyncClient(transport=httpx2.ASGITransport(
            app=build_openai_app(Frontend(config, tokenizer, LocalEngineClient(replicas)))), base_url="http://t")

    async def main():
        first, later = (EngineReplica(str(tiny_model_dir), engine, drain_timeout_s=5, model_name="tiny")
                        for _ in range(2))
        try:
            async with frontend_over([first]) as http:
                load = lambda **b: http.post("/v1/load_lora_adapter", json=b)  # noqa: E731
                refused = [await load(lora_name="x", lora_path="../../etc"), await load(lora_name="a/b", lora_path="g"),
                           await load(lora_name="tiny", lora_path="gamma"),
                           await load(lora_name="big", lora_path="too-big"), await load(lora_name="x")]
                loaded = await load(lora_name="gamma", lora_path="gamma")
                again = await load(lora_name="gamma", lora_path="gamma")
                served = await http.post("/v1/completions", json=body)
                models = (await http.get("/v1/models")).json()["data"]
            async with frontend_over([first, later], load_dir=None) as http:  # round robin: one each
                on_both = [(await http.post("/v1/completions", json=body)).json() for _ in range(2)]
                off = await http.post("/v1/load_lora_adapter", json={"lora_name": "z", "lora_path": "gamma"})
                gone = await http.post("/v1/unload_lora_adapter", json={"lora_name": "gamma"})
                after = await http.post("/v1/completions", json=body)
            # An ingress that has not polled since still sends the directory: the replica refuses it.
            stale = EngineRequest(request_id="stale", prompt_token_ids=[5, 6], params=SamplingParams(max_tokens=2), lora="gamma", lora_path=str(adapters_dir / "gamma"))
            with pytest.raises(UnknownAdapterError, match="'gamma' was unloaded"):
                [m async for m in later.generate(stale)]
            return refused, loaded, again, served, models, on_both, off, gone, after
        finally:
            await first.shutdown()
            await later.shutdown()

    refused, loaded, again, served, models, on_both, off, gone, after = asyncio.run(asyncio.wait_for(main(), 120))
    assert [(r.status_code, r.json()["error"]["param"]) for r in refused] == [
        (400, "lora_path"), (400, "lora_name"), (400, "lora_name"), (400, "lora_path"), (400, "lora_path")]
    assert "inside lora_load_dir" in refused[0].json()["error"]["message"]
    assert "rank 8 is above max_lora_rank 4" in refused[3].json()["error"]["message"]
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'gamma' added successfully."
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    llm = LLM(str(tiny_model_dir), **{**engine, "lora": {"adapters": {"gamma": str(adapters_dir / "gamma")},
                                                        "max_lora_rank": 4}})
    want = llm.generate(TEXT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        lora="gamma")[0].outputs[0].text
    assert served.json()["choices"][0]["text"] == want
    assert [(m["id"], m["parent"]) for m in models] == [("tiny", None), ("gamma", "tiny")]
    assert [o["choices"][0]["text"] for o in on_both] == [want, want]  # the later replica read it itself
    assert off.status_code == 400 and "lora_load_dir" in off.json()["error"]["message"]
    assert gone.status_code == 200 and gone.text == "Success: LoRA adapter 'gamma' removed successfully."
    assert after.status_code == 404 and "'gamma'" in after.json()["error"]["message"]


def test_adapter_endpoints_need_the_api_key_and_a_valid_body(tokenizer):
    import httpx2

    from deployments.openai_api import build_openai_app
    from tests.serving_helpers import make_frontend, run

    frontend, _ = make_frontend(tokenizer, api_keys=("k" * 16,))

    async def main():
        app = build_openai_app(frontend)
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://t") as http:
            return [await http.post(path, json=body, headers=headers) for path, body, headers in (
                ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "a"}, {}),
                ("/v1/unload_lora_adapter", {"lora_name": "a"}, {"authorization": "Bearer wrong-key-000"}),
                ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "a", "load_inplace": True},
                 {"authorization": "Bearer " + "k" * 16}),
                ("/v1/unload_lora_adapter", {"lora_name": "a", "extra": 1}, {"authorization": "Bearer " + "k" * 16}),
                ("/v1/unload_lora_adapter", {"lora_name": "a"}, {"authorization": "Bearer " + "k" * 16}))]

    answers = run(main())
    assert [a.status_code for a in answers] == [401, 401, 400, 400, 404]
    assert [a.json()["error"]["param"] for a in answers[2:]] == ["load_inplace", "extra", "lora_name"]
