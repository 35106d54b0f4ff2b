"""The sealed mesh: the fleet's own certificate authority, mutual TLS between the
services, NATS users with subject permissions, and PostgreSQL passwords."""
