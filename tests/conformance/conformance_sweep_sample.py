"""A fixed sample of the transformers sweep (benchmarks/sweep) in the conformance matrix: each
entry is a transformers architecture built from the sweep's tiny config (the config class's
defaults, shrunk), with the sweep's example inputs.

SMALL entries also run in the matrix `make test` runs (at the world sizes given); the rest with
`make conformance`. The sample spans decoders, encoders, encoder-decoders, vision and audio
models, mixtures of experts and latent attention, and the architectures a fix of the sweep made
exact (the learned position tables of Blenderbot, called with a shape; YOLOS's position
embeddings, gathered; OPT's position table split by rows on 3 ranks)."""

import functools
import os
import sys

SWEEP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "sweep")
if SWEEP not in sys.path:
    sys.path.insert(0, SWEEP)

import catalogue  # noqa: E402

# variant name -> the world sizes at which `make test` runs it (empty: `make conformance` only).
SAMPLE = {
    "blenderbot-small:causal": (2, 3),
    "blenderbot:base": (2,),
    # An RMS norm of each expert's output inside its experts module: split over the FFN axis it
    # would normalise a partial sum (1.6 off), so the experts stay whole.
    "muse_spark_text:base": (2,),
    # Its attention reads its input's length: the dry run differed, the plan was made again.
    "ctrl:causal": (2,),
    # Its position embeddings, parameters outside any layer most of the tiny tower holds, stored
    # split and gathered for each call of their module.
    "yolos:base": (2, 3),
    # On 3 ranks its learned position table is split by rows (one more all-reduce).
    "opt:causal": (3,),
    **dict.fromkeys((
        # decoders
        "apertus:causal", "arcee:causal", "cohere2:causal", "cwm:causal", "ernie4_5:causal", "exaone4:causal",
        "glm4:causal", "gpt_neo:causal", "granite:causal", "helium:causal", "internlm3:causal", "jais2:causal",
        "lfm2:causal", "ministral3:causal", "modernbert-decoder:causal", "nanochat:causal", "openai-gpt:causal",
        "seed_oss:causal", "smollm3:causal", "vaultgemma:causal", "diffllama:causal",
        # encoders
        "albert:base", "deberta-v2:base", "mpnet:base", "roc_bert:base", "tapas:base", "fnet:base",
        "megatron-bert:base",
        # encoder-decoders
        "bart:base", "mbart:base", "m2m_100:base", "mt5:base", "t5gemma:base", "plbart:base",
        # vision, audio, images beside text
        "deit:base", "dinov2:base", "clip_vision_model:base", "moonshine:base", "whisper:base", "llava:base",
        "fuyu:base"), ()),
}
# The sweep judges at 2 ranks; so does the full matrix for these.
WORLD_SIZES = (2,)
# Models run in float32 (grouped expert matmuls have no float64 CPU kernel), or computing part
# of a float64 forward in float32 (their norms): compared as the sweep compares them, at
# float32's precision of each tensor's largest value.
FP32 = {"muse_spark_text:base"}
FP32_INSIDE = FP32
FP32_INSIDE_TOLERANCE = dict(rtol=1e-4, atol=5e-5, of_largest=True)


def _build(name: str):
    return catalogue.build(catalogue.by_name(name))


def _inputs(name: str, generator):
    return catalogue.example_inputs(_build(name), generator)


def entries(arch_class):
    """The sample as conformance_table Arch entries, named sweep_<model type>_<head>."""
    return [arch_class(f"sweep_{name.replace(':', '_').replace('-', '_')}", functools.partial(_build, name),
                       functools.partial(_inputs, name), small=small, planning="parallelize",
                       tolerance=FP32_INSIDE_TOLERANCE if name in FP32_INSIDE else None, fp64=name not in FP32,
                       world_sizes=tuple(sorted(set(WORLD_SIZES) | set(small))))
            for name, small in SAMPLE.items()]
