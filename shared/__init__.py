"""What every orcapod actor imports: wire messages, Redis key names, settings, logging."""
