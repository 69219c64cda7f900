"""Small models and directories the serving tests sample from: this project's GPT as a
:class:`train.serving.Source`, a Linen model written with Flax's ``decode`` convention (as
Flax's lm1b example writes it), and a Hugging Face GPT-2 directory with a tokenizer built
offline."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from train.inspections.export import export_rules
from train.models import GPT
from train.serving import Source
from train.serving.tokenizer import CharTokenizer

VOCAB = "\n !,.:;?ACEIJLMNORTUabcdefghiklmnoprstuvwy"
WORDS = ["<unk>", "ROMEO", "JULIET", ":", "the", "king", "queen", "my", "lord", "good", "night", "love", "sweet",
         "fair", "heart", "come", "go", "thou", "art", ",", "."]


class _Rules:
    policy, rules = "mixed_bf16", None


def gpt_source(scan_layers=False, seed=0, amplify=1.0, block_size=32, d_model=32, **fields):
    """This project's GPT (random weights), served from memory: the character vocabulary above."""
    model = GPT(vocab_size=len(VOCAB), block_size=block_size, num_layers=2, num_heads=2, d_model=d_model,
                scan_layers=scan_layers, **fields)
    params = model.init(jax.random.key(seed), jnp.zeros((1, 8), jnp.int32))["params"]
    params = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), params)
    if amplify != 1.0:  # keys and values past float16's range: the cache overflows only in float16
        params["block_0"]["attn"]["qkv"]["kernel"] = params["block_0"]["attn"]["qkv"]["kernel"] * amplify
    return Source("memory", "run", model, params, {}, lambda dtype: export_rules(_Rules, dtype), CharTokenizer(VOCAB),
                  block_size, "block_size of its position embeddings", None, None)


class DecodingLM(nn.Module):
    """A causal LM written with Flax's decode convention, as the lm1b example writes it: token
    and learned position embeddings (the position counted in the ``cache`` collection while
    decoding), ``nn.MultiHeadDotProductAttention(decode=...)`` with a causal mask, a head."""

    vocab_size: int = len(VOCAB)
    max_len: int = 32
    features: int = 32
    decode: bool = False

    @nn.compact
    def __call__(self, tokens, train: bool = False):
        length = tokens.shape[1]
        positions = jnp.arange(length)
        if self.decode:  # lm1b's AddPositionEmbs: the position counted in the cache
            initializing = not self.has_variable("cache", "position")
            index = self.variable("cache", "position", lambda: jnp.zeros((), jnp.int32))
            if not initializing:
                positions, index.value = index.value + positions, index.value + length
        x = nn.Embed(self.vocab_size, self.features)(tokens)
        x = x + nn.Embed(self.max_len, self.features, name="positions")(positions)[None]
        mask = None if self.decode else nn.make_causal_mask(tokens)
        y = nn.MultiHeadDotProductAttention(num_heads=2, decode=self.decode)(nn.LayerNorm()(x), mask=mask)
        x = x + y
        x = x + nn.Dense(self.features)(nn.gelu(nn.Dense(4 * self.features)(nn.LayerNorm()(x))))
        return nn.Dense(self.vocab_size)(nn.LayerNorm()(x))


def decoding_source(seed=0):
    model = DecodingLM()
    params = model.init(jax.random.key(seed), jnp.zeros((1, 8), jnp.int32))["params"]
    params = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), params)
    return Source("memory", "run", model, params, {}, lambda dtype: export_rules(_Rules, dtype), CharTokenizer(VOCAB),
                  32, "max_len of the model", None, None)


def huggingface_gpt2(directory, transformers, width=32):
    """A tiny random GPT-2 (``width`` wide) saved with ``save_pretrained``, and a word-level
    tokenizer built offline beside it (``tokenizer.json``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>")
    config = transformers.GPT2Config(n_layer=2, n_embd=width, n_head=2, vocab_size=len(WORDS), n_positions=32,
                                     architectures=["GPT2LMHeadModel"])
    model = transformers.FlaxGPT2LMHeadModel(config, _do_init=False)  # random weights made in numpy: no init compiled
    shapes = jax.eval_shape(lambda key: model.init_weights(key, (1, 1)), jax.random.key(0))
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: np.ones(x.shape, np.float32) if jax.tree_util.keystr(path).endswith("['scale']")
        else (0.02 * rng.standard_normal(x.shape)).astype(np.float32), shapes)
    model.save_pretrained(directory, params=params)
    fast.save_pretrained(directory)
    return directory
