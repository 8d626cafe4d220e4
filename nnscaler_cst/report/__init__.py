"""What the commands print: rich tables for people, JSON for machines."""
