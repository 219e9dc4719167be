"""Finding and knowing the swarm: DHT nodes and their identities, signed and schema-checked records, the peers'
progress, the run's config fingerprint, addresses, whether others can dial this node."""
