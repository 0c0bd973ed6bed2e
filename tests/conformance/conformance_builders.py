"""Builders and example inputs for the conformance table: Hugging Face models from tiny
configs (random weights, nothing downloaded) and our own models. Every builder is called
under the same seed on every rank, so each rank builds the same model."""

import functools

import torch
from transformers import (AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSeq2SeqLM,
                          AutoModelForSpeechSeq2Seq)

import conformance_models
import idiom_models
from hf_models import from_config  # also quiets transformers' logging

VOCAB = 101
BATCH, SEQ = 2, 7  # 7 tokens: no size of the example divides evenly either

_HEADS = {
    "causal": AutoModelForCausalLM,
    "masked": AutoModelForMaskedLM,
    "seq2seq": AutoModelForSeq2SeqLM,
    "speech": AutoModelForSpeechSeq2Seq,
    "base": AutoModel,
}


def _hf_model(kind: str, head: str, config: dict):
    return from_config(_HEADS[head], kind, **config)


def hf(kind: str, head: str = "causal", **config):
    """A builder of the Hugging Face `kind` model from a tiny config, with the given head."""
    return functools.partial(_hf_model, kind, head, {"vocab_size": VOCAB, **config})


def own(**options):
    """A builder of our TinyDecoder with the given options (see conformance_models)."""
    return functools.partial(conformance_models.tiny_decoder, **options)


def own_multihead(**options):
    """A builder of our decoder of torch.nn.MultiheadAttention blocks (see conformance_models)."""
    return functools.partial(conformance_models.multihead_decoder, **options)


def idiom(name: str):
    """A builder of our plain-PyTorch model written in idiom `name` (see idiom_models)."""
    return functools.partial(idiom_models.idiom_model, name)


def _ids(generator, vocab=VOCAB, seq=SEQ):
    # Token 0 is avoided: some models treat it as padding.
    return torch.randint(1, vocab, (BATCH, seq), generator=generator)


def _token_ids(vocab, generator):
    return {"input_ids": _ids(generator, vocab)}


def token_ids(vocab=VOCAB):
    """input_ids of shape (2, 7)."""
    return functools.partial(_token_ids, vocab)


def _ids_and_encoder_states(width, generator):
    # 5 encoder positions beside 7 tokens: the cross-attention's keys are not the queries' length.
    return {"input_ids": _ids(generator), "encoder_hidden_states": torch.randn(BATCH, 5, width, generator=generator)}


def token_ids_and_encoder_states(width):
    """input_ids (2, 7) and encoder_hidden_states (2, 5, width), for a decoder's cross-attention."""
    return functools.partial(_ids_and_encoder_states, width)


def _ids_and_labels(vocab, generator):
    return {"input_ids": _ids(generator, vocab), "labels": _ids(generator, vocab)}


def token_ids_and_labels(vocab=VOCAB):
    """input_ids and labels, each of shape (2, 7)."""
    return functools.partial(_ids_and_labels, vocab)


def _features(width, generator):
    return {"features": torch.randn(BATCH, SEQ, width, generator=generator)}


def features(width):
    """features (2, 7, width): floating-point inputs that need no gradient."""
    return functools.partial(_features, width)


def _seq2seq_ids(generator):
    return {"input_ids": _ids(generator), "decoder_input_ids": _ids(generator, seq=5)}


def seq2seq_ids():
    """input_ids (2, 7) for the encoder, decoder_input_ids (2, 5) for the decoder."""
    return _seq2seq_ids


def _audio_features(mel_bins, frames, generator):
    return {"input_features": torch.randn(BATCH, mel_bins, frames, generator=generator),
            "decoder_input_ids": _ids(generator, seq=5)}


def audio_features(mel_bins, frames):
    """Log-mel features (2, mel_bins, frames) and decoder_input_ids (2, 5)."""
    return functools.partial(_audio_features, mel_bins, frames)


def _audio_beside_text(token, mel_bins, frames, per_sample, mask, generator):
    ids = _ids(generator, vocab=token)  # below the audio token
    ids = torch.cat([ids[:, :1], torch.full((BATCH, per_sample), token), ids[:, 1:]], 1)
    inputs = {"input_ids": ids, "input_features": torch.randn(BATCH, mel_bins, frames, generator=generator)}
    if mask is not None:
        inputs[mask] = torch.ones(BATCH, frames, dtype=torch.long)
    return inputs


def audio_beside_text(token, mel_bins, frames, per_sample, mask=None):
    """input_ids (2, 7 + per_sample) with `per_sample` audio tokens `token` after each sample's
    first id, log-mel features (2, mel_bins, frames) and, named `mask`, a mask of every frame."""
    return functools.partial(_audio_beside_text, token, mel_bins, frames, per_sample, mask)


def _pixels(channels, size, generator):
    return {"pixel_values": torch.randn(BATCH, channels, size, size, generator=generator)}


def pixels(channels, size):
    """pixel_values (2, channels, size, size)."""
    return functools.partial(_pixels, channels, size)
