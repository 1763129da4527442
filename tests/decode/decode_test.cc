// Tests for decode/: strict JPEG decoding, EXIF orientation, encoding, and the shared corpus.
#include <gtest/gtest.h>

#include <turbojpeg.h>

#include <cstring>
#include <filesystem>

#include "decode/jpeg_decoder.h"
#include "decode/jpeg_encoder.h"
#include "tests/testing/test_util.h"

namespace stoke::decode {
namespace {
namespace fs = std::filesystem;
using testing::EncodeJpeg;
using testing::MakeImage;

TEST(JpegDecoder, DecodesWhatWasEncoded) {
  JpegDecoder decoder;
  for (int channels : {1, 3}) {
    for (bool progressive : {false, true}) {
      SCOPED_TRACE(::testing::Message() << channels << " channels, progressive " << progressive);
      Image src = MakeImage(67, 45, channels, 3);
      auto jpeg = EncodeJpeg(src, 95, progressive, /*subsampling_444=*/true);
      ASSERT_OK_AND_ASSIGN(JpegInfo info, decoder.ReadHeader(jpeg));
      EXPECT_EQ(info.width, 67);
      EXPECT_EQ(info.height, 45);
      EXPECT_EQ(info.components, channels);
      EXPECT_EQ(info.progressive, progressive);
      EXPECT_EQ(SubsamplingName(info.subsampling), channels == 1 ? "gray" : "4:4:4");
      EXPECT_EQ(info.orientation, 1);
      Image out;
      ASSERT_OK(decoder.Decode(jpeg, &out));
      EXPECT_EQ(out.width, 67);
      EXPECT_EQ(out.height, 45);
      EXPECT_EQ(out.channels, channels);
      EXPECT_LT(testing::MeanAbsDiff(out, src), 2.0);
    }
  }
}

TEST(JpegDecoder, ScaledDecodeSizes) {
  JpegDecoder decoder;
  auto jpeg = EncodeJpeg(MakeImage(100, 60, 3));
  for (int d : {1, 2, 4, 8}) {
    Image out;
    ASSERT_OK(decoder.Decode(jpeg, &out, d));
    EXPECT_EQ(out.width, (100 + d - 1) / d);
    EXPECT_EQ(out.height, (60 + d - 1) / d);
  }
  Image out;
  EXPECT_EQ(decoder.Decode(jpeg, &out, 3).code(), StatusCode::kInvalidArgument);
}

TEST(JpegDecoder, TruncatedStreamIsCorrupt) {
  JpegDecoder decoder;
  auto jpeg = EncodeJpeg(MakeImage(64, 64, 3));
  for (double keep : {0.95, 0.6, 0.3, 0.05}) {
    SCOPED_TRACE(keep);
    std::vector<std::byte> cut(jpeg.begin(), jpeg.begin() + static_cast<ptrdiff_t>(jpeg.size() * keep));
    Image out;
    Status s = decoder.Decode(cut, &out);
    EXPECT_EQ(s.code(), StatusCode::kCorrupt);
    EXPECT_FALSE(s.message().empty());
  }
  // The decoder is reusable after an error.
  Image out;
  EXPECT_OK(decoder.Decode(jpeg, &out));
}

TEST(JpegDecoder, LenientModeAcceptsRecoverableDamageAndCountsIt) {
  DecoderOptions options;
  options.strict = false;
  JpegDecoder lenient(options);
  JpegDecoder strict;
  Image original = MakeImage(64, 64, 3);
  auto jpeg = EncodeJpeg(original);
  std::vector<std::byte> cut(jpeg.begin(), jpeg.begin() + static_cast<ptrdiff_t>(jpeg.size() * 0.6));
  Image out;
  EXPECT_EQ(strict.Decode(cut, &out).code(), StatusCode::kCorrupt);
  EXPECT_EQ(strict.last_warnings(), 0);
  // libjpeg pads the missing rows: the image comes out whole, with the warning recorded.
  ASSERT_OK(lenient.Decode(cut, &out));
  EXPECT_EQ(out.width, 64);
  EXPECT_EQ(out.height, 64);
  EXPECT_GE(lenient.last_warnings(), 1);
  EXPECT_NE(lenient.last_warning().find("Premature end"), std::string_view::npos)
      << lenient.last_warning();
  ASSERT_OK_AND_ASSIGN(auto region, lenient.DecodeRegion(cut, {0, 0, 64, 64}, 64, 64, &out));
  EXPECT_EQ(region.scale_denom, 1);
  EXPECT_GE(lenient.last_warnings(), 1);
  // A clean image afterwards reports no warnings; fatal damage still fails.
  ASSERT_OK(lenient.Decode(jpeg, &out));
  EXPECT_EQ(lenient.last_warnings(), 0);
  EXPECT_TRUE(lenient.last_warning().empty());
  std::vector<std::byte> header_only(jpeg.begin(), jpeg.begin() + 20);
  EXPECT_EQ(lenient.Decode(header_only, &out).code(), StatusCode::kCorrupt);
}

TEST(JpegDecoder, WarningsCountAsCorruption) {
  // Losing the EOI marker makes libjpeg warn ("Premature end of JPEG file") and pad the image;
  // a lenient decoder would return pixels, a strict one must not.
  JpegDecoder decoder;
  auto jpeg = EncodeJpeg(MakeImage(64, 64, 3));
  jpeg.resize(jpeg.size() - 2);
  Image out;
  Status s = decoder.Decode(jpeg, &out);
  EXPECT_EQ(s.code(), StatusCode::kCorrupt);
  EXPECT_NE(s.message().find("warning"), std::string::npos) << s.ToString();
}

TEST(JpegDecoder, GarbageIsCorrupt) {
  JpegDecoder decoder;
  std::vector<std::byte> junk(1000);
  for (size_t i = 0; i < junk.size(); ++i) junk[i] = static_cast<std::byte>(i * 31 + 7);
  Image out;
  EXPECT_EQ(decoder.Decode(junk, &out).code(), StatusCode::kCorrupt);
  EXPECT_EQ(decoder.Decode({}, &out).code(), StatusCode::kCorrupt);
  EXPECT_EQ(decoder.ReadHeader(junk).status().code(), StatusCode::kCorrupt);
  // SOI followed by junk.
  junk[0] = std::byte{0xFF};
  junk[1] = std::byte{0xD8};
  junk[2] = std::byte{0xFF};
  EXPECT_TRUE(LooksLikeJpeg(junk));
  EXPECT_EQ(decoder.Decode(junk, &out).code(), StatusCode::kCorrupt);
}

TEST(JpegDecoder, ValidateAgreesWithFullDecode) {
  JpegDecoder decoder;
  Image out;
  for (bool progressive : {false, true}) {
    auto jpeg = EncodeJpeg(MakeImage(70, 50, 3), 90, progressive);
    JpegInfo info;
    ASSERT_OK(decoder.Validate(jpeg, &info));
    EXPECT_EQ(info.width, 70);
    for (double keep : {0.97, 0.5, 0.1}) {
      std::vector<std::byte> cut(jpeg.begin(), jpeg.begin() + static_cast<ptrdiff_t>(jpeg.size() * keep));
      EXPECT_EQ(decoder.Validate(cut).code(), StatusCode::kCorrupt) << keep;
      EXPECT_EQ(decoder.Decode(cut, &out).code(), StatusCode::kCorrupt) << keep;
    }
    auto no_eoi = jpeg;
    no_eoi.resize(no_eoi.size() - 2);
    EXPECT_EQ(decoder.Validate(no_eoi).code(), StatusCode::kCorrupt);
  }
}

TEST(JpegDecoder, PixelLimit) {
  JpegDecoder decoder({.max_pixels = 1000});
  auto jpeg = EncodeJpeg(MakeImage(40, 30, 3));  // 1200 pixels
  Image out;
  EXPECT_EQ(decoder.Decode(jpeg, &out).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(decoder.ReadHeader(jpeg).status().code(), StatusCode::kResourceExhausted);
}

TEST(JpegDecoder, ScanLimit) {
  auto jpeg = EncodeJpeg(MakeImage(40, 30, 3), 90, /*progressive=*/true);  // several scans
  Image out;
  JpegDecoder strict({.max_scans = 2});
  Status s = strict.Decode(jpeg, &out);
  EXPECT_EQ(s.code(), StatusCode::kCorrupt);
  EXPECT_NE(s.message().find("scans"), std::string::npos) << s.ToString();
  JpegDecoder normal;
  EXPECT_OK(normal.Decode(jpeg, &out));
}

TEST(JpegDecoder, CmykIsConvertedToRgb) {
  // TurboJPEG writes 4-channel input as an Adobe YCCK JPEG.
  Image rgb = MakeImage(32, 32, 3, 1);
  std::vector<uint8_t> cmyk(32 * 32 * 4);
  for (int i = 0; i < 32 * 32; ++i) {
    // Adobe-inverted CMYK with K = 255 (no black): R = C, G = M, B = Y.
    cmyk[4 * i] = rgb.pixels[3 * i];
    cmyk[4 * i + 1] = rgb.pixels[3 * i + 1];
    cmyk[4 * i + 2] = rgb.pixels[3 * i + 2];
    cmyk[4 * i + 3] = 255;
  }
  tjhandle h = tjInitCompress();
  unsigned char* buf = nullptr;
  unsigned long size = 0;
  ASSERT_EQ(tjCompress2(h, cmyk.data(), 32, 0, 32, TJPF_CMYK, &buf, &size, TJSAMP_444, 95, 0), 0);
  std::vector<std::byte> jpeg(size);
  std::memcpy(jpeg.data(), buf, size);
  tjFree(buf);
  tjDestroy(h);
  JpegDecoder decoder;
  JpegInfo info;
  Image out;
  ASSERT_OK(decoder.Decode(jpeg, &out, 1, &info));
  EXPECT_TRUE(info.color_space == JpegColorSpace::kYcck || info.color_space == JpegColorSpace::kCmyk);
  EXPECT_EQ(out.channels, 3);
  EXPECT_LT(testing::MeanAbsDiff(out, rgb), 3.0);
}

TEST(Exif, OrientationInBothByteOrders) {
  auto jpeg = EncodeJpeg(MakeImage(16, 8, 3));
  JpegDecoder decoder;
  for (bool little : {true, false}) {
    for (int o = 1; o <= 8; ++o) {
      auto tagged = testing::WithExifOrientation(jpeg, o, little);
      ASSERT_OK_AND_ASSIGN(JpegInfo info, decoder.ReadHeader(tagged));
      EXPECT_EQ(info.orientation, o);
      Image out;
      EXPECT_OK(decoder.Decode(tagged, &out));  // stored pixels, unrotated
      EXPECT_EQ(out.width, 16);
    }
  }
  // Out-of-range values and malformed blocks read as 1.
  EXPECT_EQ(decoder.ReadHeader(testing::WithExifOrientation(jpeg, 0))->orientation, 1);
  EXPECT_EQ(decoder.ReadHeader(testing::WithExifOrientation(jpeg, 9))->orientation, 1);
  std::vector<std::byte> bogus = {std::byte{'E'}, std::byte{'x'}, std::byte{'i'}, std::byte{'f'},
                                  std::byte{0}, std::byte{0}, std::byte{'I'}, std::byte{'I'},
                                  std::byte{42}, std::byte{0}, std::byte{0xFF}, std::byte{0xFF},
                                  std::byte{0xFF}, std::byte{0x7F}};
  EXPECT_EQ(ParseExifOrientation(bogus), 1);
  EXPECT_EQ(ParseExifOrientation({}), 1);
}

TEST(JpegEncoder, EncodesAndRejectsBadInput) {
  ASSERT_OK_AND_ASSIGN(JpegEncoder enc, JpegEncoder::Create());
  Image img = MakeImage(30, 20, 3);
  ASSERT_OK_AND_ASSIGN(auto jpeg, enc.Encode(img, {.quality = 85}));
  JpegDecoder decoder;
  Image out;
  ASSERT_OK(decoder.Decode(jpeg, &out));
  EXPECT_LT(testing::MeanAbsDiff(out, img), 4.0);
  EXPECT_EQ(enc.Encode(img, {.quality = 0}).status().code(), StatusCode::kInvalidArgument);
  Image empty;
  EXPECT_EQ(enc.Encode(empty, {}).status().code(), StatusCode::kInvalidArgument);
}

// ---- Shared corpus (skips visibly without ../shared/data) ----

using testing::FilesUnder;

TEST(JpegCorpus, EdgeFilesDecodeExceptThe12BitAndLosslessOnes) {
  STOKE_REQUIRE_SHARED_DATA(data);
  JpegDecoder decoder;
  Image out;
  int decoded = 0, rejected = 0;
  for (const auto& f : FilesUnder(data / "edge")) {
    auto bytes = testing::ReadBytes(f);
    Status s = decoder.Decode(bytes, &out);
    const bool unsupported = f.parent_path().filename() == "unsupported_by_ljt2";
    if (unsupported) {
      EXPECT_EQ(s.code(), StatusCode::kCorrupt) << f;
      ++rejected;
    } else {
      EXPECT_TRUE(s.ok()) << f << ": " << s.ToString();
      EXPECT_GT(out.width, 0);
      ++decoded;
    }
  }
  EXPECT_EQ(decoded, 98);
  EXPECT_EQ(rejected, 8);
}

TEST(JpegCorpus, EveryBadJpegIsRejected) {
  STOKE_REQUIRE_SHARED_DATA(data);
  // Every bad/ file made libjpeg fail or warn, so a strict decoder must reject each of them.
  JpegDecoder decoder;
  Image out;
  int checked = 0;
  for (const auto& f : FilesUnder(data / "bad")) {
    auto bytes = testing::ReadBytes(f);
    Status s = decoder.Decode(bytes, &out);
    EXPECT_FALSE(s.ok()) << f << " decoded as " << out.width << "x" << out.height;
    ++checked;
  }
  EXPECT_EQ(checked, 271);
}

TEST(JpegCorpus, ValidateAcceptsExactlyWhatAFullDecodeAccepts) {
  STOKE_REQUIRE_SHARED_DATA(data);
  // The pack tool's default validation must neither let through a file that a full-size strict
  // decode rejects, nor reject one it accepts.
  JpegDecoder decoder;
  Image out;
  int accepted = 0, rejected = 0;
  for (const char* set : {"edge", "bad"}) {
    for (const auto& f : FilesUnder(data / set)) {
      auto bytes = testing::ReadBytes(f);
      const bool full = decoder.Decode(bytes, &out).ok();
      const Status fast = decoder.Validate(bytes);
      EXPECT_EQ(fast.ok(), full) << f << ": " << fast.ToString();
      (full ? accepted : rejected)++;
    }
  }
  EXPECT_EQ(accepted, 98);
  EXPECT_EQ(rejected, 8 + 271);
}

TEST(JpegCorpus, HeaderReportsSubsampling) {
  STOKE_REQUIRE_SHARED_DATA(data);
  JpegDecoder decoder;
  const std::pair<const char*, const char*> cases[] = {
      {"gen_brambling_q90_444.jpg", "4:4:4"}, {"gen_brambling_q90_422.jpg", "4:2:2"},
      {"gen_brambling_q90_420.jpg", "4:2:0"}, {"gen_brambling_q90_440.jpg", "4:4:0"},
      {"gen_brambling_q90_411.jpg", "4:1:1"}, {"gen_brambling_q90_410.jpg", "4:1:0"},
      {"gen_brambling_q90_gray.jpg", "gray"}};
  for (auto [file, want] : cases) {
    ASSERT_OK_AND_ASSIGN(JpegInfo info,
                         decoder.ReadHeader(testing::ReadBytes(data / "edge" / "subsampling" / file)));
    EXPECT_EQ(SubsamplingName(info.subsampling), want) << file;
  }
}

TEST(JpegCorpus, ImagenetOrientationTag) {
  STOKE_REQUIRE_SHARED_DATA(data);
  JpegDecoder decoder;
  auto bytes = testing::ReadBytes(data / "imagenet_like" / "n02951585" / "n02951585_can_opener.JPEG");
  ASSERT_OK_AND_ASSIGN(JpegInfo info, decoder.ReadHeader(bytes));
  EXPECT_EQ(info.orientation, 6);
  EXPECT_EQ(info.width, 392);
  EXPECT_EQ(info.height, 294);
}

}  // namespace
}  // namespace stoke::decode
