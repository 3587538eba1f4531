"""Record encryption: KMS providers (moto's server on loopback), data keys, the envelope."""
