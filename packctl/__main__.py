"""`python -m packctl` = the `packctl` command."""
from packctl.cli import main

main()
