"""The words users see about a channel's security: what a controller's settings leave open,
and what a connection that failed usually means."""

from __future__ import annotations

from recover.common.security import Security


def exposure(security: Security, loopback: bool) -> str:
    """What a controller listening with `security` leaves open to whoever reaches its port
    (empty: nothing worth a warning). Loopback is this machine's own business."""
    if loopback or (security.tls and security.authenticates_clients):
        return ""
    if not security.enabled:
        return ("without TLS or a token: anyone who reaches it can act as an agent or an "
                "operator and read the job (see README \"Securing a cluster\")")
    if not security.tls:
        return ("with tokens but without TLS: tokens and the job's messages cross the network "
                "in the clear (see README \"Securing a cluster\")")
    return ("with TLS but neither --tls-ca nor a token: the channel is encrypted, yet anyone "
            "who reaches it can act as an agent or an operator (see README \"Securing a "
            "cluster\")")


def explain_transport(details: str, tls: bool) -> str:
    """gRPC's words for a connection that failed, with what usually causes it (`tls`: this
    client spoke TLS)."""
    text = details.lower()
    if "certificate_verify_failed" in text or "certificate verify failed" in text:
        return (f"the TLS handshake failed: a certificate was not accepted ({details.strip()})"
                ": is it signed by the CA given as --tls-ca, unexpired, and issued for this "
                "address?")
    if "handshake" in text or "ssl" in text or "tls" in text:
        return (f"the TLS handshake failed ({details.strip()}): do both sides use TLS, with "
                "certificates from the same CA (and a client certificate where the controller "
                "requires one)?")
    closed = "socket closed" in text or "connection reset" in text or "end of file" in text
    if closed and tls:
        return (f"the controller ended the TLS handshake ({details.strip()}): does it require "
                "a client certificate (--tls-cert/--tls-key) signed by its CA, and is yours "
                "unexpired and from that CA?")
    if closed:
        return (f"the controller closed the connection ({details.strip()}): does it serve "
                "TLS? (then give --tls-ca, and --tls-cert/--tls-key if it requires them)")
    return details.strip()
