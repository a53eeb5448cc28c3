"""Authentication and tenant identity shared by every service (the lowest layer above proto)."""
