"""Random ops: uniform, normal, bernoulli, dropout, randperm, multinomial, ... (keys from ctx.rng_key())."""
