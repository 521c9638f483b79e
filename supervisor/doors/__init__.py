"""What every door (HTTP, the CLI) shares: the typed interface to the supervisor, its
implementation, the views it hands out, the errors it refuses with, the chat client."""
