//! An audio file as a source of mono samples ([`Source`]): its container read by Symphonia, its
//! first audio track decoded a packet at a time (Opus by libopus, through
//! `symphonia-adapter-libopus`; every other codec by Symphonia), each packet's channels mixed
//! to one.
//!
//! An MP4 file reaches Symphonia's MP4 reader only when it opens with its `ftyp` box and its
//! boxes passed `mp4.rs`'s check; no other file is probed as MP4.
//!
//! A source keeps its file's bytes (checked once) to be read again from the start
//! ([`Source::rewind`]): a long file is decoded twice rather than held decoded.
//!
//! What the file's header states is checked before it costs anything: a sample rate outside
//! [`super::RATES`] is refused naming it, and a RIFF WAVE header's rate is read here before
//! Symphonia reads it, since Symphonia 0.5 panics on a rate of 0 (the caller catches panics
//! too, for what no check here foresees).

use std::io::Cursor;
use std::sync::{Arc, LazyLock};

use symphonia::core::audio::SampleBuffer;
use symphonia::core::codecs::{CODEC_TYPE_AAC, CODEC_TYPE_NULL, CodecRegistry, Decoder, DecoderOptions};
use symphonia::core::errors::Error as Symphonia;
use symphonia::core::formats::{FormatOptions, FormatReader};
use symphonia::core::io::MediaSourceStream;
use symphonia::core::meta::MetadataOptions;
use symphonia::core::probe::{Hint, Probe};
use symphonia::default::formats::{FlacReader, IsoMp4Reader, MkvReader, MpaReader, OggReader, WavReader};
use symphonia_metadata::id3v2::Id3v2Reader;

use super::{AudioError, RATES, mp4};

/// Symphonia's codecs and libopus' Opus decoder, which Symphonia 0.5 lacks.
static CODECS: LazyLock<CodecRegistry> = LazyLock::new(|| {
    let mut codecs = CodecRegistry::new();
    symphonia::default::register_enabled_codecs(&mut codecs);
    codecs.register_all::<symphonia_adapter_libopus::OpusDecoder>();
    codecs
});

/// Every container served but MP4 (and ID3v2 tags, which MP3 files open with): Symphonia's
/// probe finds a container's mark anywhere in a file's first MiB, and its MP4 reader must only
/// see a file `mp4::check` passed.
static CONTAINERS: LazyLock<Probe> = LazyLock::new(|| {
    let mut probe = Probe::default();
    probe.register_all::<WavReader>();
    probe.register_all::<FlacReader>();
    probe.register_all::<MpaReader>();
    probe.register_all::<OggReader>();
    probe.register_all::<MkvReader>();
    probe.register_all::<Id3v2Reader>();
    probe
});

/// MP4 alone, for a file that opens with its `ftyp` box and passed `mp4::check`.
static MP4: LazyLock<Probe> = LazyLock::new(|| {
    let mut probe = Probe::default();
    probe.register_all::<IsoMp4Reader>();
    probe
});

/// A file's bytes, checked, shared by each reading of it.
struct File {
    bytes: Arc<Vec<u8>>,
    /// Its MP4 tracks, when it is MP4 (its boxes checked).
    mp4: Option<Vec<mp4::Track>>,
}

/// A reading of [`File`]'s bytes: Symphonia reads from any byte slice it owns.
struct Reading(Arc<Vec<u8>>);

impl AsRef<[u8]> for Reading {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

/// A file's first decodable audio track, being decoded.
pub(super) struct Source {
    file: File,
    format: Box<dyn FormatReader>,
    decoder: Box<dyn Decoder>,
    track: u32,
    /// Its samples per second, within [`RATES`].
    pub(super) rate: u32,
    /// Why the first damaged packet could not be decoded.
    damaged: Option<String>,
    /// Frames still to drop from the front: AAC's encoder priming in an MP4 file.
    priming: u64,
}

impl Source {
    /// Open `bytes` as an audio file of at most `limit_seconds`: its container recognised (an
    /// MP4 file's boxes checked first), its track and codec found and its rate checked.
    pub(super) fn open(mut bytes: Vec<u8>, limit_seconds: u64) -> Result<Source, AudioError> {
        if let Some(rate) = wav_rate(&bytes).filter(|r| !RATES.contains(r)) {
            return Err(AudioError::Rate(rate));
        }
        let mp4 = match mp4::is_mp4(&bytes) {
            true => Some(mp4::check(&mut bytes, limit_seconds)?),
            false => None,
        };
        Source::read(File {
            bytes: Arc::new(bytes),
            mp4,
        })
    }

    /// The same file read again from its start, as it was first read.
    pub(super) fn rewind(self) -> Result<Source, AudioError> {
        Source::read(self.file)
    }

    /// Read `file` from its start: its track and codec found and its rate checked.
    fn read(file: File) -> Result<Source, AudioError> {
        let probe = if file.mp4.is_some() { &*MP4 } else { &*CONTAINERS };
        let reading = Box::new(Cursor::new(Reading(Arc::clone(&file.bytes))));
        let stream = MediaSourceStream::new(reading, Default::default());
        let probed = probe
            .format(
                &Hint::new(),
                stream,
                &FormatOptions {
                    // Encoder delay and padding (MP3's LAME header, Vorbis' pre-skip) are not
                    // audio: they would shift every later frame, as ffmpeg, which trims them,
                    // does not.
                    enable_gapless: true,
                    ..FormatOptions::default()
                },
                &MetadataOptions::default(),
            )
            .map_err(|e| match e {
                // A container recognised and cut before its header ends is damaged, not foreign.
                Symphonia::IoError(io) if io.kind() == std::io::ErrorKind::UnexpectedEof => {
                    AudioError::Corrupt("it ends before its header does".into())
                }
                e => AudioError::Format(e.to_string()),
            })?;
        let format = probed.format;
        let track = format
            .tracks()
            .iter()
            .find(|t| t.codec_params.codec != CODEC_TYPE_NULL)
            .ok_or_else(|| AudioError::Codec("no track names a codec".into()))?;
        let (id, params) = (track.id, track.codec_params.clone());
        let rate = params
            .sample_rate
            .ok_or_else(|| AudioError::Codec("the track does not say its sample rate".into()))?;
        if !RATES.contains(&rate) {
            return Err(AudioError::Rate(rate));
        }
        let decoder = CODECS
            .make(&params, &DecoderOptions::default())
            .map_err(|e| AudioError::Codec(e.to_string()))?;
        // Symphonia's MP4 reader and AAC decoder give the encoder's priming as audio; ffmpeg
        // drops what the edit list says precedes the media, and so does this. (Opus in MP4
        // states its pre-skip there too, which libopus' adapter drops already.)
        let tracks = file.mp4.as_deref().unwrap_or_default();
        let priming = match tracks.get(id as usize) {
            Some(track) if params.codec == CODEC_TYPE_AAC => track.priming(rate),
            _ => 0,
        };
        Ok(Source {
            file,
            format,
            decoder,
            track: id,
            rate,
            damaged: None,
            priming,
        })
    }

    /// Decode the next packet of the track, its channels mixed to one, onto `mono`: `false` at
    /// the end of the stream.
    pub(super) fn next(&mut self, mono: &mut Vec<f32>) -> Result<bool, AudioError> {
        loop {
            let packet = match self.format.next_packet() {
                Ok(packet) => packet,
                // The end of the stream (a file cut short ends here too, with what it held).
                Err(Symphonia::IoError(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(false),
                Err(Symphonia::ResetRequired) => return Ok(false),
                Err(e) => return Err(AudioError::Corrupt(e.to_string())),
            };
            if packet.track_id() != self.track {
                continue;
            }
            let decoded = match self.decoder.decode(&packet) {
                Ok(decoded) => decoded,
                // A damaged packet is skipped, as players and ffmpeg skip it; a file of nothing
                // but damaged packets is refused by `end`.
                Err(Symphonia::DecodeError(e)) => {
                    self.damaged.get_or_insert_with(|| e.to_string());
                    continue;
                }
                Err(e) => return Err(AudioError::Corrupt(e.to_string())),
            };
            let spec = *decoded.spec();
            // Every packet is at the track's rate: a stream that changes it is not one recording.
            if spec.rate != self.rate {
                return Err(AudioError::Corrupt(format!(
                    "its packets change the sample rate from {} Hz to {} Hz",
                    self.rate, spec.rate
                )));
            }
            let channels = spec.channels.count().max(1);
            let gain = downmix_gain(channels);
            let mut buffer = SampleBuffer::<f32>::new(decoded.capacity() as u64, spec);
            buffer.copy_interleaved_ref(decoded);
            let frames = buffer.samples().chunks(channels);
            let primed = (self.priming.min(frames.len() as u64)) as usize;
            self.priming -= primed as u64;
            mono.extend(frames.skip(primed).map(|frame| frame.iter().sum::<f32>() * gain));
            return Ok(true);
        }
    }

    /// The stream has ended having given `samples` samples: a file whose every packet was
    /// damaged is refused with why the first was.
    pub(super) fn end(&self, samples: u64) -> Result<(), AudioError> {
        match &self.damaged {
            Some(why) if samples == 0 => Err(AudioError::Corrupt(why.clone())),
            _ => Ok(()),
        }
    }
}

/// What each channel's samples are multiplied by in the mono sum. Stereo is mixed as ffmpeg's
/// `-ac 1` mixes it (each channel at -3 dB, 1/√2), which is how Whisper's own `load_audio` and
/// `transformers`' ASR pipeline read a file, so a stereo clip gives the features those give;
/// other layouts are averaged.
fn downmix_gain(channels: usize) -> f32 {
    match channels {
        2 => std::f32::consts::FRAC_1_SQRT_2,
        n => 1.0 / n as f32,
    }
}

/// The sample rate the `fmt ` chunk of a RIFF WAVE file states, when `bytes` is one and has it
/// (chunks are walked from the first, each padded to an even length).
fn wav_rate(bytes: &[u8]) -> Option<u32> {
    let u32_at = |at: usize| {
        bytes
            .get(at..at + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    if bytes.get(0..4) != Some(b"RIFF") || bytes.get(8..12) != Some(b"WAVE") {
        return None;
    }
    let mut at = 12usize;
    loop {
        let (id, size) = (bytes.get(at..at + 4)?, u32_at(at + 4)? as usize);
        if id == b"fmt " {
            // The rate follows the format tag and the channel count.
            return u32_at(at + 12);
        }
        at = at.checked_add(8 + size + size % 2)?;
    }
}
