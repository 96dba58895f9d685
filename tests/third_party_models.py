"""Small Hugging Face Flax models (transformers 4.46.3), built from configs.

Nothing is downloaded: each model is a config and its Flax module. These are
models nobody here wrote, used to check that the built-in policies select
real tensors in them and that the figures equal JAX's own accounting.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest

transformers = pytest.importorskip("transformers")

BATCH, SEQ, VOCAB = 2, 8, 64


def _shim_clip() -> None:
  """Flax T5 calls ``jnp.clip(a_max=...)``, which newer JAX dropped."""
  if getattr(jnp.clip, "_third_party_shim", False):
    return
  original = jnp.clip

  @functools.wraps(original)
  def clip(a, a_min=None, a_max=None, *args, **kwargs):
    if a_min is not None:
      kwargs.setdefault("min", a_min)
    if a_max is not None:
      kwargs.setdefault("max", a_max)
    return original(a, *args, **kwargs)
  clip._third_party_shim = True
  jnp.clip = clip


@dataclasses.dataclass(frozen=True)
class ThirdPartyModel:
  """A third-party linen module with inputs and a loss over its params."""
  name: str
  module: Any  # the unbound linen module (``FlaxPreTrainedModel.module``)
  inputs: dict[str, Any]

  def init(self, module: Any = None) -> Any:
    module = self.module if module is None else module
    return module.init(jax.random.key(0), **self.inputs)["params"]

  def loss(self, module: Any = None) -> Callable[[Any], Any]:
    """``params -> scalar``: the mean of squares of the first output."""
    module = self.module if module is None else module

    def loss(params):
      out = module.apply({"params": params}, **self.inputs)
      first = out[0] if isinstance(out, tuple) else next(iter(out.values()))
      return jnp.mean(jnp.square(first.astype(jnp.float32)))
    return loss


def _ids(shape=(BATCH, SEQ)):
  return jnp.arange(shape[0] * shape[1], dtype=jnp.int32).reshape(
      shape) % VOCAB


def gpt2() -> ThirdPartyModel:
  config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2,
                                   vocab_size=VOCAB, n_positions=SEQ)
  model = transformers.FlaxGPT2LMHeadModel(config, _do_init=False)
  ids = _ids()
  return ThirdPartyModel("gpt2", model.module, {
      "input_ids": ids, "attention_mask": jnp.ones_like(ids),
      "position_ids": jnp.broadcast_to(jnp.arange(SEQ), ids.shape)})


def bert() -> ThirdPartyModel:
  config = transformers.BertConfig(
      num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
      intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=SEQ)
  model = transformers.FlaxBertModel(config, _do_init=False)
  ids = _ids()
  return ThirdPartyModel("bert", model.module, {
      "input_ids": ids, "attention_mask": jnp.ones_like(ids),
      "token_type_ids": jnp.zeros_like(ids), "position_ids": jnp.broadcast_to(
          jnp.arange(SEQ), ids.shape), "head_mask": None})


def t5() -> ThirdPartyModel:
  _shim_clip()
  config = transformers.T5Config(
      num_layers=2, num_decoder_layers=2, d_model=32, d_kv=16, d_ff=64,
      num_heads=2, vocab_size=VOCAB, decoder_start_token_id=0)
  model = transformers.FlaxT5ForConditionalGeneration(config, _do_init=False)
  ids = _ids()
  return ThirdPartyModel("t5", model.module, {
      "input_ids": ids, "attention_mask": jnp.ones_like(ids),
      "decoder_input_ids": ids, "decoder_attention_mask": jnp.ones_like(ids)})


def llama() -> ThirdPartyModel:
  config = transformers.LlamaConfig(
      num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
      num_key_value_heads=2, intermediate_size=64, vocab_size=VOCAB,
      # Its rotary table keeps only the first max_position_embeddings of
      # 2 * head_dim columns: it needs at least 2 * head_dim positions.
      max_position_embeddings=64)
  model = transformers.FlaxLlamaForCausalLM(config, _do_init=False)
  ids = _ids()
  return ThirdPartyModel("llama", model.module, {
      "input_ids": ids, "attention_mask": jnp.ones_like(ids),
      "position_ids": jnp.broadcast_to(jnp.arange(SEQ), ids.shape)})


#: Builders by name; each returns a fresh :class:`ThirdPartyModel`.
BUILDERS = {"gpt2": gpt2, "bert": bert, "t5": t5, "llama": llama}

#: The block class of each model (what a user would otherwise have to know).
BLOCK_CLASSES = {"gpt2": "FlaxGPT2Block", "bert": "FlaxBertLayer",
                 "t5": "FlaxT5LayerCollection", "llama": "FlaxLlamaDecoderLayer"}


# Models whose repeated block is not the outermost stack of indexed modules:
# ResNet / RegNet (stages of residual layers), Wav2Vec2 (a convolutional
# feature extractor before the transformer layers), ALBERT (one layer module
# applied num_hidden_layers times). Their variables include batch_stats, so
# these builders give the module and its call's inputs only.

def resnet() -> ThirdPartyModel:
  config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16],
                                     depths=[2, 2], num_channels=3)
  model = transformers.FlaxResNetModel(config, _do_init=False)
  return ThirdPartyModel("resnet", model.module,
                         {"pixel_values": jnp.ones((1, 32, 32, 3))})


def regnet() -> ThirdPartyModel:
  config = transformers.RegNetConfig(embedding_size=8, hidden_sizes=[8, 16],
                                     depths=[2, 2], groups_width=8,
                                     num_channels=3)
  model = transformers.FlaxRegNetModel(config, _do_init=False)
  return ThirdPartyModel("regnet", model.module,
                         {"pixel_values": jnp.ones((1, 32, 32, 3))})


def wav2vec2() -> ThirdPartyModel:
  config = transformers.Wav2Vec2Config(
      hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
      intermediate_size=32, conv_dim=(8, 8), conv_stride=(5, 2),
      conv_kernel=(10, 3), num_conv_pos_embeddings=4,
      num_conv_pos_embedding_groups=2, do_stable_layer_norm=True,
      feat_extract_norm="layer")
  model = transformers.FlaxWav2Vec2Model(config, _do_init=False)
  return ThirdPartyModel("wav2vec2", model.module,
                         {"input_values": jnp.ones((1, 400))})


def albert() -> ThirdPartyModel:
  config = transformers.AlbertConfig(
      num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
      intermediate_size=64, embedding_size=16, vocab_size=VOCAB,
      max_position_embeddings=SEQ)
  model = transformers.FlaxAlbertModel(config, _do_init=False)
  ids = _ids()
  return ThirdPartyModel("albert", model.module, {
      "input_ids": ids, "attention_mask": jnp.ones_like(ids),
      "token_type_ids": jnp.zeros_like(ids),
      "position_ids": jnp.broadcast_to(jnp.arange(SEQ), ids.shape)})


#: Builders of the models above, by name.
DEPTH_BUILDERS = {"resnet": resnet, "regnet": regnet, "wav2vec2": wav2vec2,
                  "albert": albert}
