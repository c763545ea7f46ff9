"""The durable, lag-aware, authenticated gRPC trajectory queue: server, client, log store."""
