"""Test session set-up: 8 emulated CPU devices, fixed before anything starts the JAX backend."""

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
