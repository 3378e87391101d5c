"""slates.sdk: the Python clients of the local Slates service."""

from slates.sdk.client import AsyncClient, Client

__all__ = ["AsyncClient", "Client"]
