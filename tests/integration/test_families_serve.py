"""The newer families through `kvserve serve` with the real `openai` client: a Qwen3-MoE mixture from its GGUF,
Phi-4-mini (partial rotary, LongRoPE) and Mixtral from safetensors directories, tiny random models of
transformers' own classes (tests/hf_factory.py) served side by side. Greedy completions are transformers'
tokens; chat, whole and streamed, goes through each model's chat template."""
from __future__ import annotations

import pytest
import torch

from tests.hf_factory import tiny_model, write_gguf, write_hf_dir
from tests.live_server import LiveServer, tiny_model_toml

pytestmark = pytest.mark.timeout(600)

# model id -> (family, file kind)
SERVED = {"tiny-qwen3moe": ("qwen3moe", "gguf"), "tiny-phi4mini": ("phi4mini", "hf"), "tiny-mixtral": ("mixtral", "hf")}
PROMPT = [17, 2054, 931, 4011, 88, 7, 12500, 301]


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm2_gguf_path):
    root = tmp_path_factory.mktemp("families-serve")
    models, tomls = {}, []
    for model_id, (family, kind) in SERVED.items():
        model = tiny_model(family, seed=5)
        path = write_gguf(model, root / f"{family}.gguf", str(smollm2_gguf_path)) if kind == "gguf" \
            else write_hf_dir(model, root / family, str(smollm2_gguf_path))
        models[model_id] = model
        tomls.append(tiny_model_toml(path, model_id, max_model_len=256, blocks=64))
    srv = LiveServer(tmp_path_factory.mktemp("families-home"), "\n".join(tomls)).start()
    yield srv, models
    srv.stop()


def test_each_family_is_listed(served):
    srv, _ = served
    assert set(SERVED) <= {m.id for m in srv.openai().models.list().data}


@pytest.mark.parametrize("model_id", list(SERVED))
def test_greedy_completion_is_transformers(served, model_id, smollm2_gguf_path):
    from kvserve.models.tokenizer import Tokenizer

    srv, models = served
    with torch.no_grad():
        expected = models[model_id].generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False)[0, len(PROMPT):]
    r = srv.openai().completions.create(model=model_id, prompt=PROMPT, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
    tokenizer = Tokenizer.from_gguf(str(smollm2_gguf_path))
    assert r.choices[0].text == tokenizer.decode(expected.tolist())


@pytest.mark.parametrize("model_id", list(SERVED))
def test_chat_whole_and_streamed(served, model_id):
    srv, _ = served
    client = srv.openai()
    args = dict(model=model_id, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=10,
                temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**args)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 10
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        **args, stream=True) if chunk.choices)
    assert streamed == whole.choices[0].message.content

