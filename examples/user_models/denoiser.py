"""A model with several named inputs, as a diffusion UNet takes them (see denoiser.yaml):

    model(sample=..., timesteps=..., encoder_hidden_states=...)

The data function returns ``inputs`` as a dict of arrays (one row per example each);
the framework calls the model with them as keyword arguments, in training, evaluation,
``--explain``, ``--diagnose`` and ``--compile-for`` alike. The model is written the way
Hugging Face diffusers writes its Flax UNet: it accepts only a JAX array of timesteps.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


class TinyDenoiser(nn.Module):
    """Predicts the noise added to ``sample`` at ``timesteps``, conditioned on a text-like
    context: a convolution, a sinusoidal time embedding added per channel, GroupNorm, and
    attention from the pixels to the context."""

    channels: int = 16
    groups: int = 4

    @nn.compact
    def __call__(self, sample, timesteps, encoder_hidden_states):
        if not isinstance(timesteps, jax.Array):  # as diffusers does: a Python number is one timestep
            timesteps = jnp.array([timesteps], dtype=jnp.int32)
        elif timesteps.ndim == 0:
            timesteps = timesteps[None]
        assert timesteps.ndim == 1, "Timesteps should be a 1d-array"
        half = self.channels // 2
        freqs = jnp.exp(-jnp.log(10_000.0) * jnp.arange(half) / half)
        angles = timesteps[:, None].astype(jnp.float32) * freqs[None]
        t_emb = nn.Dense(self.channels, name="time_emb_proj")(jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], -1))
        h = nn.Conv(self.channels, (3, 3), name="conv_in")(sample)
        h = nn.silu(nn.GroupNorm(num_groups=self.groups, name="norm")(h + t_emb[:, None, None, :]))
        batch, height, width, _ = h.shape
        pixels = h.reshape(batch, height * width, self.channels)
        attended = nn.MultiHeadDotProductAttention(num_heads=2, name="cross_attn")(pixels, encoder_hidden_states)
        h = (pixels + attended).reshape(batch, height, width, self.channels)
        return nn.Conv(sample.shape[-1], (3, 3), name="conv_out")(h)


def noisy_images(examples: int = 512, size: int = 8, context: int = 4, width: int = 12, seed: int = 0):
    """Images of smooth blobs with Gaussian noise added at random timesteps: the model
    learns to predict the noise. ``inputs`` holds the model's three inputs by name."""
    rng = np.random.default_rng(seed)
    grid = np.linspace(-1, 1, size)
    centres = rng.uniform(-0.5, 0.5, (examples, 2, 1, 1))
    clean = np.exp(-((grid[None, :, None] - centres[:, 0]) ** 2 + (grid[None, None, :] - centres[:, 1]) ** 2) * 4)
    clean = np.repeat(clean[..., None], 3, -1).astype(np.float32)
    timesteps = rng.integers(0, 1000, examples).astype(np.int32)
    noise_level = (timesteps / 1000.0).astype(np.float32)[:, None, None, None]
    noise = rng.standard_normal(clean.shape).astype(np.float32)
    sample = np.sqrt(1 - noise_level) * clean + np.sqrt(noise_level) * noise
    hidden = rng.standard_normal((examples, context, width)).astype(np.float32)
    split = int(examples * 0.8)

    def part(rows):
        return {"inputs": {"sample": sample[rows], "timesteps": timesteps[rows],
                           "encoder_hidden_states": hidden[rows]},
                "noise": noise[rows]}

    return {"train": part(slice(None, split)), "eval": part(slice(split, None)), "name": "noisy blobs"}


def noise_mse(predicted, batch):
    """The denoising loss: mean squared error of the predicted noise (in float32)."""
    error = jnp.mean((predicted - batch["noise"]) ** 2)
    return error, {"mse": error}
