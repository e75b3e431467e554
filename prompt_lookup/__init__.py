from .ngram import POLICIES, PromptLookupSource, find_draft
