"""Embeddings (engine.pooling, deployments.embeddings): a prompt's final hidden states pooled and
normalised, equal to HF transformers' ``AutoModel`` in every way the engine may run them (alone, in a
batch beside generation, cut into prefill chunks, after a cached prefix); no KV block kept; served by
``/v1/embeddings`` (the openai SDK) and gRPC ``Embed`` with the same vectors."""

from __future__ import annotations

import base64
import shutil

import numpy as np
import openai
import pytest
import torch

from deployments.errors import BadRequest
from deployments.proto_gen.slotserve.v1 import slotserve_pb2 as pb
from engine.errors import InvalidRequestError
from engine.llm import LLM
from engine.pooling import pooling_of
from engine.sampling import SamplingParams
from tests.real_serving import GrpcContext, GrpcService
from tests.serving_helpers import frontend_over, real_replica, run
from tests.test_serving_frontend import _clients

PROMPTS = ["hello world, how are you today", "the quick brown fox jumps over the lazy dog " * 6, "a"]


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tokenizer):
    """Per pooling mode, each prompt's embedding as HF transformers computes it."""
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    out = {"last": [], "mean": []}
    with torch.no_grad():
        for prompt in PROMPTS:
            states = hf(torch.tensor([tokenizer.encode(prompt)])).last_hidden_state[0]
            out["last"].append(torch.nn.functional.normalize(states[-1], dim=-1))
            out["mean"].append(torch.nn.functional.normalize(states.mean(0), dim=-1))
    return out


def _close(ours, theirs) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert torch.allclose(torch.tensor(a), b, atol=2e-5), (torch.tensor(a) - b).abs().max()


@pytest.mark.parametrize("mode", ["last", "mean"])
def test_embeddings_match_hf_however_the_engine_runs_them(tiny_model_dir, reference, mode):
    # Chunks of 16 tokens: the long prompt's states come from three steps.
    llm = LLM(str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=256, max_num_seqs=4,
              max_num_batched_tokens=16, enable_chunked_prefill=True)
    _close(llm.embed(PROMPTS, pooling=mode), reference[mode])
    # Again, beside generation (decodes in the same steps) and after the prompts' blocks were cached.
    params = [SamplingParams(max_tokens=12, temperature=0), SamplingParams(pooling=mode, max_tokens=1)] * 3
    outs = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[1], PROMPTS[0], "x y z", PROMPTS[2]], params)
    _close([outs[1].embedding, outs[3].embedding, outs[5].embedding], [reference[mode][i] for i in (1, 0, 2)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [12, 0] * 3
    stats = llm.engine.stats()
    assert stats.kv_blocks_used == 0 and stats.running == 0
    assert stats.num_generated_tokens == 36  # an embedding keeps no token


def test_pooling_is_the_model_directorys_and_takes_no_generation_fields(tiny_model_dir, tmp_path):
    assert pooling_of(tiny_model_dir) == "last"
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    (model / "1_Pooling").mkdir()
    (model / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    assert pooling_of(model) == "mean"
    for extra in ({"n": 2}, {"logprobs": 1}, {"prompt_logprobs": 0}):
        with pytest.raises(InvalidRequestError, match="pooling"):
            SamplingParams(pooling="last", **extra)


@pytest.fixture(scope="module")
def replica(tiny_model_dir):
    return real_replica(tiny_model_dir)


def test_served_over_http_and_grpc(replica, tiny_model_dir, tokenizer, reference):
    fe = frontend_over(replica, tiny_model_dir, tokenizer)

    async def main():
        from deployments.openai_api import build_openai_app

        client, http = _clients(build_openai_app(fe))
        done = await client.embeddings.create(model="tiny", input=PROMPTS)  # the SDK asks for base64
        _close([d.embedding for d in done.data], reference["last"])
        assert [d.index for d in done.data] == [0, 1, 2]
        assert done.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in PROMPTS)
        raw = await client.embeddings.with_raw_response.create(model="tiny", input=PROMPTS[0],
                                                               encoding_format="base64")
        vector = np.frombuffer(base64.b64decode(raw.http_response.json()["data"][0]["embedding"]), dtype="<f4")
        _close([vector.tolist()], reference["last"][:1])
        ids = await client.embeddings.create(model="tiny", input=[tokenizer.encode(PROMPTS[2])],
                                             encoding_format="float")
        _close([ids.data[0].embedding], reference["last"][2:])
        for kwargs, param in (({"input": ["ok", ""]}, "input.1"), ({"input": "ok", "dimensions": 3}, "dimensions"),
                              ({"input": [[10**9]]}, "input")):
            with pytest.raises(openai.BadRequestError) as err:
                await client.embeddings.create(model="tiny", **kwargs)
            assert err.value.body["param"] == param, err.value.body
        with pytest.raises(openai.NotFoundError):
            await client.embeddings.create(model="other", input="x")
        await http.aclose()
        grpc = GrpcService(fe)
        out = await grpc.Embed(pb.EmbedRequest(text=PROMPTS[1]))
        assert out.prompt_tokens == len(tokenizer.encode(PROMPTS[1]))
        _close([list(out.embedding)], reference["last"][1:2])
        context = GrpcContext()
        with pytest.raises(BadRequest):
            await grpc.Embed(pb.EmbedRequest(), context)
        assert context.code.name == "INVALID_ARGUMENT" and "text" in context.details
        assert replica.engine.stats().kv_blocks_used == 0
    run(main(), timeout_s=120)


@pytest.mark.parametrize("limit", ["max_concurrent_requests", "max_waiting"])
def test_a_tenants_inputs_wait_within_its_concurrency_limit(replica, tiny_model_dir, tokenizer, limit):
    from deployments.embeddings import embed
    from deployments.tenants import Tenant

    one = Tenant("one-at-a-time", ("key-one-at-a-time",), **{limit: 1})
    fe = frontend_over(replica, tiny_model_dir, tokenizer, tenants=(one,))
    vectors, tokens = run(embed(fe, PROMPTS, "tiny", one))  # eight at a time would be refused past the first
    assert len(vectors) == 3 and tokens == sum(len(tokenizer.encode(p)) for p in PROMPTS)
