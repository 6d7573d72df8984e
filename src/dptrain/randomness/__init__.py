"""Randomness: one secret stream per purpose (noise, sampling, mixing, preprocessing), seeded from the operating
system's CSPRNG; the AES-256-CTR stream for ``privacy.secure_noise``; the stream interface."""
