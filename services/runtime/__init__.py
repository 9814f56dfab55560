"""What every Prorsa service shares: the NATS connection and streams, the embedded server, the service base,
logging and metrics. Services import this and `proto`, never each other."""
