"""Speech for the tutor: audio in (decode, check, transcribe with Whisper) and audio out
(synthesise a reply sentence by sentence as its text streams), all on the CPU and offline.

Nothing here knows about HTTP; `server/audio.py` turns it into routes. Whisper and PyAV come with
the `voice` extra, speech synthesis from Debian's espeak-ng (or GPL Piper, the `voice-piper`
extra); without them, `asr_missing()` / `load_tts()` say why and the server answers 501.
"""
