"""A rack's relay between its agents and the leader (`recover relay`): see relay/server.py."""
