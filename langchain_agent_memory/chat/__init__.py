"""The LangChain chat model and what it needs: prompts, tool formats, reasoning, profiles, agent ids."""
